"""`--quantization int8` on SmolLM2-135M-Instruct holds its quality against fp32 (both on our engine core):
perplexity on a fixed long English text (Python's own help topics, `pydoc_data.topics`) within 2% of fp32's,
and, on the tier's chat prompts, fp32's greedy continuation is int8's top token at 90%+ of the positions
(teacher-forced, so one near-tie does not decide every later position)."""

from __future__ import annotations

import dataclasses
import math
from pydoc_data.topics import topics

import pytest
import torch

from duet.model_dir import read_model_dir
from duet.tokenizer import Tokenizer
from engine_core import LLM
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool
from engine_core.model_runner import ModelRunner
from tests.realmodel.test_real_parity import GREEDY, PAGE

TEXT_TOKENS = 1024


def _runner(smollm2_dir, quantization):
    md = read_model_dir(smollm2_dir)
    c = md.config
    pool = KVPool(c.num_hidden_layers, TEXT_TOKENS // PAGE + 8, PAGE, c.num_key_value_heads, c.head_dim,
                  "float32", "cpu")
    return ModelRunner(md, pool, "cpu", quantization=quantization)


@pytest.fixture(scope="module")
def runners(smollm2_dir):
    return {q: _runner(smollm2_dir, q) for q in ("none", "int8")}


@torch.inference_mode()
def _all_logits(runner, ids):
    pages = list(range(-(-len(ids) // PAGE)))
    return runner.forward([SeqChunk(ids, 0, pages, tuple(range(len(ids))))])


def test_int8_perplexity_on_the_pydoc_topics_is_within_2_percent_of_fp32(smollm2_dir, runners):
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = Tokenizer.from_dir(smollm2_dir).encode(text)[:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    ppl = {}
    for q, runner in runners.items():
        nll = torch.nn.functional.cross_entropy(_all_logits(runner, ids)[:-1], torch.tensor(ids[1:]))
        ppl[q] = math.exp(nll.item())
    assert ppl["int8"] <= ppl["none"] * 1.02, ppl
    assert ppl["none"] < 30, ppl  # the text is English the model reads well: a broken fp32 path shows here


def test_int8_agrees_with_fp32_greedy_on_the_chat_prompts(smollm2_dir, runners, fp32_greedy_chats):
    tok = Tokenizer.from_dir(smollm2_dir)
    prompts, fp32 = fp32_greedy_chats
    same = total = 0
    for prompt, continuation in zip(prompts, fp32):
        ids = prompt + continuation
        top = _all_logits(runners["int8"], ids)[len(prompt) - 1:-1].argmax(-1)
        same += (top == torch.tensor(continuation)).sum().item()
        total += len(continuation)
    assert same / total >= 0.9, f"int8 picks fp32's greedy token at {same}/{total} positions"
    # and the served path generates with int8 end to end, the first answer word for word (its first sentence is
    # 7 tokens: greedy, 16 tokens start as the 64 did)
    [out] = LLM(smollm2_dir, page_size=PAGE, quantization="int8").generate([prompts[0]],
                                                                          dataclasses.replace(GREEDY, max_tokens=16))
    assert tok.decode(out.outputs[0].token_ids).startswith("The capital of France is Paris.")
