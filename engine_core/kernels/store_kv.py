"""Scatter new keys and values into the paged KV cache.

Contract (both implementations):
  store_kv(k, v, k_cache, v_cache, slot_mapping) -> None
      # k, v [T, Hk, D]; k_cache, v_cache [num_pages, page_size, Hk, D];
      # slot_mapping [T] int64, slot = page * page_size + offset; every slot must be valid (no padding sentinel).
Values are cast to the cache dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton
from engine_core.kernels.bounds import check_slots, checks_apply


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    num_pages, page_size, hk, d = k_cache.shape
    k_cache.view(num_pages * page_size, hk, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_pages * page_size, hk, d)[slot_mapping] = v.to(v_cache.dtype)


@lazy_jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: all of its heads in one [BLOCK_H, BLOCK_D] tile
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"store_kv: k and v must both be [tokens, kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"store_kv: caches must both be [num_pages, page_size, {k.shape[1]}, {k.shape[2]}], "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv: slot_mapping must be [{k.shape[0]}] int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()):
        raise ValueError("store_kv: k_cache and v_cache must be contiguous")
    if len({t.device for t in (k, v, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("store_kv: all tensors must be on one device")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    if checks_apply(k):
        check_slots("store_kv", slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        heads, dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
    )
