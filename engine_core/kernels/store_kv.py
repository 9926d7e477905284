"""Scatter new keys and values into the paged KV cache.

Contract (both implementations):
  store_kv(k, v, k_cache, v_cache, slot_mapping) -> None
      # k, v [T, Hk, D]; k_cache, v_cache [num_pages, page_size, Hk, D];
      # slot_mapping [T] int64, slot = page * page_size + offset; every slot must be valid (no padding sentinel).
Values are cast to the cache dtype.
"""

from __future__ import annotations

from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    num_pages, page_size, hk, d = k_cache.shape
    k_cache.view(num_pages * page_size, hk, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_pages * page_size, hk, d)[slot_mapping] = v.to(v_cache.dtype)
