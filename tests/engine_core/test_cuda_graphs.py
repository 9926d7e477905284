"""engine_core/cuda_graphs.py: which graph a decode step replays (on any machine), and on a CUDA device that a
replayed step gives the eager step's logits and stores K/V only in its own pages and the scratch page."""

from __future__ import annotations

import pytest
import torch

from duet.engine_config import ENGINE_DEFAULTS
from duet.model_dir import read_model_dir
from engine_core.builder import build_runtime
from engine_core.cuda_graphs import DecodeGraphs, batch_bucket, width_bucket
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool
from engine_core.model_runner import ModelRunner

CUDA = torch.cuda.is_available()


def test_a_step_takes_the_smallest_batch_bucket_that_holds_it():
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 17, 64, 65, 256)] == [1, 2, 4, 24, 64, 96, 256]
    assert batch_bucket(257, 256) is None
    assert batch_bucket(50, 64) == 64 and batch_bucket(65, 64) is None


def test_page_tables_widen_in_powers_of_two_up_to_the_model_length():
    assert [width_bucket(p, 8192) for p in (1, 16, 17, 100, 8192)] == [16, 16, 32, 128, 8192]
    assert width_bucket(90, 100) == 100  # the next power of two is past the model's length: capped there
    assert width_bucket(101, 100) is None


def test_the_scratch_page_lies_past_the_pages_the_allocator_hands_out():
    pool = KVPool(2, 10, 16, 2, 8, "float32", "cpu", scratch_page=True)
    assert pool.num_pages == 10 and pool.scratch_page == 10
    assert all(c.shape[0] == 11 for c in pool.k_caches + pool.v_caches)
    assert KVPool(2, 10, 16, 2, 8, "float32", "cpu").scratch_page is None


def test_a_step_is_copied_into_the_static_inputs_with_padding_rows_on_the_scratch_page():
    pool = KVPool(1, 12, 4, 1, 8, "float32", "cpu", scratch_page=True)
    graphs = DecodeGraphs(torch.nn.Identity(), pool, max_model_len=64)  # the model is only run at capture
    chunks = [SeqChunk([7], 5, [3, 9]), SeqChunk([8], 0, [4])]  # token 7 at position 5 (page 9, offset 1)
    shape = graphs.shape_for(chunks)
    assert shape == (2, 16)
    graphs._fill(chunks, 4, 16)  # a batch of 4: two padding rows
    assert graphs.input_ids[:4].tolist() == [7, 8, 0, 0]
    assert graphs.positions[:4].tolist() == [5, 0, 0, 0]
    assert graphs.slots[:4].tolist() == [9 * 4 + 1, 4 * 4, 12 * 4, 12 * 4]
    assert graphs.context_lens[:4].tolist() == [6, 1, 1, 1]
    tables = graphs.block_tables[:4, :16]
    assert tables[0, :2].tolist() == [3, 9] and tables[1, :1].tolist() == [4]
    assert (tables[0, 2:] == 12).all() and (tables[2:] == 12).all()  # unused entries: the scratch page
    # multi-token chunks, or a chunk that wants no logits, run eagerly
    assert graphs.shape_for([SeqChunk([1, 2], 0, [0])]) is None
    assert graphs.shape_for([SeqChunk([1], 3, [0], logits_positions=())]) is None


def test_graphs_are_on_by_default_and_only_on_cuda(hf_checkpoints):
    assert ENGINE_DEFAULTS.enforce_eager is False
    rt = build_runtime(read_model_dir(hf_checkpoints["llama"][0]), device="cpu", page_size=16, num_pages=8)
    assert rt.runner.decode_graphs is None and rt.pool.scratch_page is None


def _runner(path, graphs: bool, num_pages=96, page_size=4):
    md = read_model_dir(path)
    c = md.config
    pool = KVPool(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim, "float32", "cuda",
                  scratch_page=graphs)
    return ModelRunner(md, pool, "cuda")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_a_replayed_decode_step_equals_the_eager_one(hf_checkpoints, arch, batch):
    path = hf_checkpoints[arch][0]
    graphed, eager = _runner(path, graphs=True), _runner(path, graphs=False)
    assert graphed.decode_graphs is not None and eager.decode_graphs is None
    g = torch.Generator().manual_seed(batch)
    lens = [int(n) for n in torch.randint(3, 60, (batch,), generator=g)]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(batch)]  # 64 positions each at page size 4
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]
    for r in (graphed, eager):
        r.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    tokens = [p[-1] for p in prompts]
    for step in range(3):
        chunks = [SeqChunk([tok], n + step, t) for tok, n, t in zip(tokens, lens, tables)]
        got, want = graphed.forward(chunks), eager.forward(chunks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        tokens = want.argmax(-1).tolist()
    assert graphed.decode_graphs.num_graphs >= 1
    # padding rows stored their K/V in the scratch page only: pages no sequence owns are still zero
    unused = slice(16 * batch, graphed.kv_pool.num_pages)
    assert all(not c[unused].any() for c in graphed.kv_pool.k_caches + graphed.kv_pool.v_caches)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_prefill_and_mixed_steps_stay_eager(hf_checkpoints):
    runner = _runner(hf_checkpoints["llama"][0], graphs=True)
    runner.forward([SeqChunk([5, 6, 7], 0, [0]), SeqChunk([8], 3, [1])])
    assert runner.decode_graphs.num_graphs == 0
