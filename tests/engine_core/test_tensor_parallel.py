"""Tensor parallelism on CPU (gloo): the split is refused when it cannot divide, every rank holds exactly its
part, and a model split over 2 or 3 ranks gives the logits (fp32 tolerance) and greedy tokens of one rank.

`make gpu-check` runs the parity tests again on GPUs (DUET_TP_TEST_DEVICE=cuda: NCCL, one GPU per rank); a
test that needs more GPUs than are visible is skipped there."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from duet.model_dir import read_model_dir
from duet.model_make import cached_model_dir, make_checkpoint
from engine_core.errors import TensorParallelError
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool
from engine_core.model_runner import ModelRunner
from engine_core.parallel import check_divisible, start_tensor_parallel
from engine_core.parallel.plan import ShardPlan, local_config, shard_plan

DEVICE = os.environ.get("DUET_TP_TEST_DEVICE", "cpu")
# fp32; the all-reduce sums partial products in another order than one matmul does (GPU GEMMs reorder more)
# fp32: the all-reduce sums each row-parallel matmul in another order than one rank's GEMM does; with the native CPU
# attention that moved a qwen2 logit (about 1.3) by 1.2e-5. A wrong shard moves logits by far more than this.
ATOL = 2e-5 if DEVICE == "cpu" else 1e-4


@pytest.fixture(autouse=True)
def _plain_cpu_matmuls(monkeypatch):
    """Every rank and the one-rank reference on F.linear: the reference's decode steps would otherwise take the
    oneDNN-packed copies (engine_core/cpu_linear.py), which the ranks do not keep, and the comparison would
    measure two GEMMs' summation orders (1.2e-5 on qwen2) rather than the split. The ranks inherit the variable."""
    monkeypatch.setenv("DUET_CPU_PACKED_WEIGHTS", "0")


def test_a_split_that_does_not_divide_is_refused_naming_both_numbers(tmp_path):
    from duet.engine_config import EngineConfig, PagedConfig
    from engine_paged.worker import build_engine

    config = read_model_dir(make_checkpoint(tmp_path, preset="tiny")).config  # 4 heads, 2 KV heads
    with pytest.raises(TensorParallelError, match=r"3 does not divide the model's 4 attention heads"):
        check_divisible(config, 3)
    with pytest.raises(TensorParallelError, match=r"3 does not divide the model's 4 attention heads"):
        # refused before any rank process starts
        build_engine(PagedConfig(EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=3)))
    smollm2_shape = dataclasses.replace(config, num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(TensorParallelError, match=r"2 does not divide the model's 9 attention heads"):
        check_divisible(smollm2_shape, 2)


def test_ranks_hold_disjoint_slices_that_make_up_the_whole_model(tmp_path):
    config = read_model_dir(make_checkpoint(tmp_path, preset="bench")).config  # 8 heads, 2 KV heads
    d = config.head_dim
    q = torch.arange(config.num_attention_heads * d * 3.0).reshape(-1, 3)
    k = torch.arange(config.num_key_value_heads * d * 3.0).reshape(-1, 3)
    o = q.t().contiguous()
    for tp in (2, 4):
        plans = [shard_plan(config, tp, r) for r in range(tp)]
        assert torch.equal(torch.cat([p.shard("model.layers.0.self_attn.q_proj.weight", q) for p in plans]), q)
        assert torch.equal(torch.cat([p.shard("model.layers.0.self_attn.o_proj.weight", o) for p in plans], 1), o)
        # 2 KV heads over 4 ranks: each rank keeps the head its query heads attend to (each replicated twice)
        heads = [0, 1] if tp == 2 else [0, 0, 1, 1]
        for plan, h in zip(plans, heads):
            assert torch.equal(plan.shard("model.layers.0.self_attn.k_proj.weight", k), k[h * d:(h + 1) * d])
            assert local_config(config, plan).num_key_value_heads == 1
    # a vocabulary the ranks do not divide: ceil(8000 / 3) rows each, the last rank's padded with zeros
    plans = [ShardPlan(3, r, num_heads=9, num_kv_heads=3, head_dim=4, intermediate_size=12, vocab_size=8000)
             for r in range(3)]
    embed = torch.randn(8000, 4)
    parts = [p.shard("model.embed_tokens.weight", embed) for p in plans]
    assert [tuple(x.shape) for x in parts] == [(2667, 4)] * 3
    assert torch.equal(torch.cat(parts)[:8000], embed) and not parts[2][-1].any()


def _reference(path):
    md = read_model_dir(path)
    c = md.config
    pool = KVPool(c.num_hidden_layers, 32, 16, c.num_key_value_heads, c.head_dim, "float32", DEVICE)
    return ModelRunner(md, pool, DEVICE)


def _skip_without_devices(tp: int) -> None:
    if DEVICE == "cuda" and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on CUDA needs {tp} GPUs, {torch.cuda.device_count()} visible")


def _greedy_run(runner, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Both prompts prefilled in one batch, then `steps` greedy decode steps of both: every step's logits and
    the tokens chosen. Pages 1.. are given out by hand (page 0 is the warm-up token's)."""
    tables = [[1 + 8 * i + j for j in range(8)] for i in range(len(prompts))]
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]
    tokens: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    for _ in range(steps + 1):
        logits = runner.forward(chunks)
        all_logits.append(logits)
        for seq, row in zip(tokens, logits.argmax(-1).tolist()):
            seq.append(row)
        chunks = [SeqChunk([seq[-1]], len(p) + len(seq) - 1, t) for p, seq, t in zip(prompts, tokens, tables)]
    return all_logits, tokens


def _assert_same_as_one_rank(path, tp: int, steps: int) -> None:
    _skip_without_devices(tp)
    md = read_model_dir(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(md.config.vocab_size, 256), (n,), generator=g).tolist() for n in (23, 9)]
    want_logits, want_tokens = _greedy_run(_reference(path), prompts, steps)
    runner = start_tensor_parallel(md, tp, device=DEVICE, page_size=16, kv_cache_tokens=32 * 16)
    try:
        assert runner.kv_pool.num_kv_heads == max(1, md.config.num_key_value_heads // tp)
        got_logits, got_tokens = _greedy_run(runner, prompts, steps)
        assert runner.stats()["all_reduce_calls"] > 0
    finally:
        runner.close()
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_one_rank(hf_checkpoints, arch):
    """4 heads / 2 KV heads over 2 ranks: untied head (llama), qkv bias + tied head (qwen2), q/k norm and
    head_dim != hidden / heads (qwen3)."""
    path, _ = hf_checkpoints[arch]
    _assert_same_as_one_rank(path, 2, steps=4)


def test_three_ranks_on_the_smollm2_shape_match_one_rank():
    """SmolLM2-135M's shape (9 heads, 3 KV heads, 30 layers, tied 49152-row head), random weights."""
    _assert_same_as_one_rank(cached_model_dir("smollm2", "llama"), 3, steps=2)
