"""Paged decode attention on CPU that reads K/V where they lie in the page cache (csrc/paged_decode.c).

    paged_decode_native(q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> out [B, Hq, D]

Decode reads every cached K and V row once a layer, so it is bound by memory bandwidth: the kernel reads each row
once, in place (the torch path copied every layer's pages first: 39% of a decode step on SmolLM2's shape), and
spends little more than the bytes (16 rows x 600 context, 30 layers, 2 threads: about 21 GB/s of the VM's 26).
Built and loaded by cpu_native.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.kernels.cpu_native import KV_SUFFIX, library


def paged_decode_native(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                        scale: float, max_context: int, lib=None) -> Tensor:
    """q [B, Hq, D] fp32; caches [pages, page_size, Hk, D] fp32 or bf16 (contiguous); block_tables [B, P] and
    context_lens [B] int32, contiguous (the plan makes them so once per step). out fp32. Same result as
    paged_decode_attention_ref. `lib`: the kernels to call (default this checkout's, `library()`)."""
    lib = lib or library()
    assert lib is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and q.dtype == torch.float32
    q = q.contiguous()
    rows, hq, d = q.shape
    hk, page_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, -(-max(1, max_context) // 16) * 16 * hq, dtype=torch.float32)
    kernel = getattr(lib, f"paged_decode_{KV_SUFFIX[k_cache.dtype]}")
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
           block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), rows, hq, hk, d,
           page_size, scale, scratch.data_ptr(), scratch.stride(0), threads)
    return out
