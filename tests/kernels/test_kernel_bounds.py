"""The launchers refuse what would make a kernel read or write outside the cache (engine_core/kernels/bounds.py):
a used page id past the cache, a length past its table row, query ranges past q, slots past the cache, and tiles
the kernel cannot run. Entries past a sequence's pages stay ignored, as the contract says. Under
DUET_KERNEL_TEST_DEVICE=cuda the same tests check the checks on the GPU (DUET_KERNEL_CHECKS=1)."""

from __future__ import annotations

from importlib import import_module

import pytest
import torch

decode = import_module("engine_core.kernels.decode_attention")
extend = import_module("engine_core.kernels.extend_attention")
store = import_module("engine_core.kernels.store_kv")


@pytest.fixture(autouse=True)
def _checks_on_cuda_too(monkeypatch):
    # on a GPU (DUET_KERNEL_TEST_DEVICE=cuda) the checks run only when asked: ask, so that the bad inputs below
    # are refused there too instead of faulting the device
    monkeypatch.setenv("DUET_KERNEL_CHECKS", "1")


def _decode_args(kv, q):
    return q, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125


def test_decode_refuses_a_used_page_past_the_cache(paged_kv):
    kv = paged_kv([5, 20], 16, 1, 16, torch.float32)  # sequence 1 uses two pages
    q = torch.randn(2, 2, 16)
    kv.block_tables[1, 1] = kv.k_cache.shape[0]  # one past the last page
    with pytest.raises(ValueError, match=r"sequence 1's page 1 is page id \d+, outside the cache's \d+ pages"):
        decode.paged_decode_attention_triton(*_decode_args(kv, q))


def test_decode_ignores_entries_past_a_sequences_pages(paged_kv):
    kv = paged_kv([5, 20], 16, 1, 16, torch.float32)
    q = torch.randn(2, 2, 16)
    kv.block_tables[0, 1:] = 10_000  # sequence 0 uses one page: the rest of its row is never read
    out = decode.paged_decode_attention_triton(*_decode_args(kv, q))
    torch.testing.assert_close(out, decode.paged_decode_attention_ref(*_decode_args(kv, q)), atol=2e-5, rtol=2e-5)


def test_decode_refuses_a_context_longer_than_its_table_row(paged_kv):
    kv = paged_kv([5, 20], 16, 1, 16, torch.float32)
    kv.lens[0] = kv.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="sequence 0 has 49 tokens, but its block-table row holds 3 pages"):
        decode.paged_decode_attention_triton(*_decode_args(kv, torch.randn(2, 2, 16)))


def _extend_args(kv, prefix, new):
    q = torch.randn(sum(new), 2, 16)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return [q, kv.k_cache, kv.v_cache, kv.block_tables, cu, torch.tensor(prefix, dtype=torch.int32), 0.25]


def test_extend_refuses_a_used_page_past_the_cache(paged_kv):
    kv = paged_kv([3 + 9, 20 + 2], 4, 1, 16, torch.float32)
    args = _extend_args(kv, [3, 20], [9, 2])
    kv.block_tables[0, 2] = -1
    with pytest.raises(ValueError, match="sequence 0's page 2 is page id -1"):
        extend.extend_attention_triton(*args)


def test_extend_refuses_query_ranges_past_q_or_past_max_seqlen(paged_kv):
    kv = paged_kv([12, 22], 4, 1, 16, torch.float32)
    args = _extend_args(kv, [3, 20], [9, 2])
    with pytest.raises(ValueError, match="more than max_seqlen_q=4"):
        extend.extend_attention_triton(*args, max_seqlen_q=4)
    args[4] = torch.tensor([0, 9, 12], dtype=torch.int32)  # 12 rows claimed, q has 11
    with pytest.raises(ValueError, match="within q's 11 rows"):
        extend.extend_attention_triton(*args)


@pytest.mark.parametrize("tile, problem", [((8, 16, 4, 2), "BLOCK_M=8"), ((16, 48, 4, 2), "BLOCK_N=48"),
                                           ((16, 16, 3, 2), "num_warps=3"), ((16, 16, 4, 0), "num_stages=0")])
def test_extend_refuses_tiles_the_kernel_cannot_run(paged_kv, tile, problem):
    kv = paged_kv([12], 4, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=f"tile .* cannot run: {problem}"):
        extend.extend_attention_triton(*_extend_args(kv, [3], [9]), tile=tile)


def test_store_kv_refuses_a_slot_past_the_cache():
    k = torch.randn(3, 2, 16)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="token 2 has slot 16, outside the cache's 16 slots"):
        store.store_kv_triton(k, k, k_cache, v_cache, torch.tensor([0, 15, 16]))
    assert not k_cache.any()  # nothing was written
