"""bf16 on SmolLM2-135M-Instruct (what `--dtype auto` serves on a CPU with AMX or AVX512_BF16) holds fp32's
quality, both on our engine core: perplexity on a fixed long English text (Python's own help topics,
`pydoc_data.topics`) within 1% of fp32's, and on the tier's chat prompts fp32's greedy continuation is bf16's top
token at 90%+ of the positions (teacher-forced; the share is printed: `pytest -s`). It runs on any CPU (oneDNN or
torch's reference matmuls where the CPU has no bf16 path): only the speed differs."""

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
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def runners(smollm2_dir):
    md = read_model_dir(smollm2_dir)
    c = md.config

    def runner(dtype):  # weights, activations and the KV cache in `dtype`
        pool = KVPool(c.num_hidden_layers, TEXT_TOKENS // PAGE + 8, PAGE, c.num_key_value_heads, c.head_dim,
                      dtype, "cpu")
        return ModelRunner(md, pool, "cpu", dtype)

    return {dtype: runner(dtype) for dtype in DTYPES}


@torch.inference_mode()
def _all_logits(runner, ids):
    pages = list(range(-(-len(ids) // PAGE)))
    return runner.forward([SeqChunk(ids, 0, pages, tuple(range(len(ids))))])


def test_bf16_perplexity_on_the_pydoc_topics_is_within_1_percent_of_fp32(smollm2_dir, runners):
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = Tokenizer.from_dir(smollm2_dir).encode(text)[:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    ppl = {}
    for dtype, runner in runners.items():
        logits = _all_logits(runner, ids)
        assert logits.dtype == torch.float32  # sampling and the loss see fp32 logits in both
        ppl[dtype] = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    print(f"perplexity on {TEXT_TOKENS} pydoc tokens: fp32 {ppl['float32']:.4f}, bf16 {ppl['bfloat16']:.4f} "
          f"({ppl['bfloat16'] / ppl['float32'] - 1:+.2%})")
    assert abs(ppl["bfloat16"] / ppl["float32"] - 1) <= 0.01, ppl
    assert ppl["float32"] < 30, ppl  # the text is English the model reads well: a broken fp32 path shows here


def test_bf16_agrees_with_fp32_greedy_on_the_chat_prompts(smollm2_dir, runners, fp32_greedy_chats):
    tok = Tokenizer.from_dir(smollm2_dir)
    prompts, fp32 = fp32_greedy_chats
    same = total = 0
    for prompt, continuation in zip(prompts, fp32):
        ids = prompt + continuation
        top = _all_logits(runners["bfloat16"], ids)[len(prompt) - 1:-1].argmax(-1)
        same += (top == torch.tensor(continuation)).sum().item()
        total += len(continuation)
    print(f"bf16 picks fp32's greedy token at {same}/{total} positions ({same / total:.1%}, teacher-forced)")
    assert same / total >= 0.9, f"bf16 picks fp32's greedy token at {same}/{total} positions"
    # and the served path generates in bf16 end to end (paged decode over a bf16 cache), the first answer's start
    # (that sentence is 7 tokens: greedy, 16 tokens start as the 64 did)
    llm = LLM(smollm2_dir, page_size=PAGE, dtype="bfloat16")
    [out] = llm.generate([prompts[0]], dataclasses.replace(GREEDY, max_tokens=16))
    assert llm.runner.kv_pool.k_caches[0].dtype == torch.bfloat16
    assert tok.decode(out.outputs[0].token_ids).startswith("The capital of France is Paris.")
