"""Prompt scoring on SmolLM2 through the whole stack, on each engine kind, as lm-evaluation-harness's
`local-completions` backend asks for it (a batch of token-id prompts, `echo`, `logprobs: 1`,
`max_tokens: 0`): every prompt token's logprob equals transformers' log-softmax (fp32, a prefill: 1e-4),
the first is null, and a context's continuation scores the same whether or not the context is cached."""

from __future__ import annotations

import pytest
import torch

from duet.tokenizer import Tokenizer

KINDS = ("paged", "prefix")
MODEL = "smollm2-135m-instruct"
TEXTS = ["The capital of France is Paris.", "Water boils at one hundred degrees Celsius at sea level.",
         "def add(a, b):\n    return a + b"]


@pytest.mark.parametrize("kind", KINDS)
def test_echo_scores_every_prompt_token_like_transformers(clients, kind, smollm2_dir, hf_smollm2):
    tok = Tokenizer.from_dir(smollm2_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    for attempt in range(2):  # the second time every prompt's pages are cached: scoring must not change
        r = clients[kind].completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 0
        for ids, choice in zip(prompts, r.choices):
            with torch.inference_mode():
                ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)
            lp = choice.logprobs
            assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
            want = [ref[i - 1, t].item() for i, t in enumerate(ids) if i]
            assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4), (kind, attempt)
            # is_greedy as lm_eval computes it: the token's logprob is the best alternative's
            greedy = [ref[i - 1].argmax().item() == t for i, t in enumerate(ids) if i]
            assert [abs(v - max(top.values())) < 1e-6 for v, top in
                    zip(lp.token_logprobs[1:], lp.top_logprobs[1:])] == greedy
            assert choice.text == tok.decode(ids)
