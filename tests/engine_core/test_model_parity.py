"""Our decoder over paged KV equals transformers' logits (fp32, 1e-4) and greedy tokens, for every arch; the
mixed decode batches also with `--compile` (engine_core.cpu_compile), through its 1-token and generic graphs."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from duet.model_dir import read_model_dir
from engine_core import LLM, SamplingParams
from engine_core.cpu_compile import is_compiled
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool, PageAllocator
from engine_core.model_runner import ModelRunner

ATOL = 1e-4


def _runner(path, page_size, num_pages=96, compile=False):
    md = read_model_dir(path)
    c = md.config
    pool = KVPool(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim, "float32", "cpu")
    runner = ModelRunner(md, pool, "cpu", compile=compile)
    assert is_compiled(runner.model) == compile
    return runner, PageAllocator(num_pages)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@torch.inference_mode()
def _hf_logits(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("page_size", [16, 4])
def test_prefill_whole_and_chunked_match_transformers(hf_checkpoints, arch, page_size):
    path, hf = hf_checkpoints[arch]
    runner, alloc = _runner(path, page_size)
    ids = _prompt(70, seed=1)
    ref = _hf_logits(hf, ids)
    n = len(ids)

    pages = alloc.alloc(-(-n // page_size))
    whole = runner.forward([SeqChunk(ids, 0, pages, tuple(range(n)))])
    torch.testing.assert_close(whole, ref, atol=ATOL, rtol=0)

    # the same prompt in three chunks through fresh pages; each chunk attends to the pages of the earlier ones
    pages = alloc.alloc(-(-n // page_size))
    got = []
    for start, end in ((0, 13), (13, 41), (41, n)):
        got.append(runner.forward([SeqChunk(ids[start:end], start, pages, tuple(range(end - start)))]))
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size, compile", [(16, False), (4, False), (4, True)],
                         ids=["page16", "page4", "page4-compiled"])
def test_decode_step_by_step_in_mixed_batches_matches_transformers(hf_checkpoints, arch, page_size, compile):
    """a: 9-token prefill then one token per step. b: 5-token prefill chunks up to 20, then one token per step.
    Early steps mix a's decode with b's prefill chunks; later ones are pure decode of two ragged sequences, then
    of b alone (a batch of 1 token: compiled, its own graph)."""
    path, hf = hf_checkpoints[arch]
    runner, alloc = _runner(path, page_size, compile=compile)
    # b comes first in the callers' order, so a's decode row (flattened first) must come back second
    seqs = {"b": _prompt(45, seed=3), "a": _prompt(40, seed=2)}
    refs = {k: _hf_logits(hf, ids) for k, ids in seqs.items()}
    pages = {k: alloc.alloc(-(-len(ids) // page_size)) for k, ids in seqs.items()}
    done = {"a": 0, "b": 0}
    prefill_until = {"a": 9, "b": 20}
    graphs = counters["stats"]["unique_graphs"]
    while any(done[k] < len(seqs[k]) for k in seqs):
        chunks, expected = [], []
        for k, ids in seqs.items():
            start = done[k]
            if start >= len(ids):
                continue
            step = prefill_until[k] if k == "a" and start == 0 else (5 if start < prefill_until[k] else 1)
            end = min(start + step, len(ids))
            chunks.append(SeqChunk(ids[start:end], start, pages[k], tuple(range(end - start))))
            expected.append(refs[k][start:end])
            done[k] = end
        torch.testing.assert_close(runner.forward(chunks), torch.cat(expected), atol=ATOL, rtol=0)
    assert counters["stats"]["unique_graphs"] == graphs, "compiled again while serving: the warm-up missed a graph"


@torch.inference_mode()
def _hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy_64(hf_checkpoints):
    """hf_greedy_64(arch, ids) -> transformers' greedy 64 tokens after `ids`: the reference of the three greedy
    tests below, generated once per checkpoint and prompt (it is deterministic) instead of once per test."""
    done: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def get(arch: str, ids: list[int]) -> list[int]:
        key = (arch, tuple(ids))
        if key not in done:
            done[key] = _hf_greedy(hf_checkpoints[arch][1], ids, 64)
        return done[key]

    return get


def test_greedy_64_tokens_alone_matches_transformers_generate(hf_checkpoints, hf_greedy_64, arch):
    path, _ = hf_checkpoints[arch]
    ids = _prompt(21, seed=4)
    [out] = LLM(path, page_size=16).generate([ids], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy_64(arch, ids)
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_64_tokens_in_a_ragged_batch_matches_transformers_generate(hf_checkpoints, hf_greedy_64, arch,
                                                                         compile):
    """Three prompts of different lengths together, odd page size, a small token budget so that prefill
    chunks of one prompt share steps with decode tokens of the others."""
    path, _ = hf_checkpoints[arch]
    prompts = [_prompt(21, seed=4), _prompt(5, seed=5), _prompt(47, seed=6)]
    llm = LLM(path, page_size=4, max_num_batched_tokens=16, compile=compile)
    assert is_compiled(llm.runner.model) == compile
    outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy_64(arch, ids)
