"""Extend (prefill) attention: new tokens attend causally to themselves and fully to their cached prefix.

Contract (both implementations):
  extend_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale) -> out [T, Hq, D]
      # q [T, Hq, D]: the new tokens of all sequences, flattened; cu_seqlens_q [B+1] int32 (sequence i owns rows
      # cu[i]:cu[i+1]); prefix_lens [B] int32 = tokens cached before this chunk. The new tokens' K/V are ALREADY
      # in the pages (store_kv runs first), so everything is read through block_tables [B, max_pages]. Token j of
      # sequence i sits at position prefix_lens[i] + j and attends to cache positions 0 .. that position.
The softmax and both products are computed in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton
from engine_core.kernels.decode_attention import check_paged_args, gather_pages


def check_extend_args(q: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor, prefix_lens: Tensor) -> None:
    b = prefix_lens.shape[0]
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != b + 1:
        raise ValueError(
            f"extend_attention: cu_seqlens_q must be [B+1] = [{b + 1}], got {tuple(cu_seqlens_q.shape)}"
        )
    if block_tables.shape[0] != b:
        raise ValueError(f"extend_attention: block_tables has {block_tables.shape[0]} rows for {b} sequences")


def extend_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    scale: float,
) -> Tensor:
    check_paged_args("extend_attention", q, k_cache, v_cache, block_tables)
    check_extend_args(q, block_tables, cu_seqlens_q, prefix_lens)
    t, hq, d = q.shape
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
    g = hq // hk
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    # one vectorized attention per sequence: its pages gathered into contiguous K/V, a causal mask offset by
    # the prefix length
    for i, prefix in enumerate(prefixes):
        start, end = cu[i], cu[i + 1]
        n = end - start
        if n == 0:
            continue
        total = prefix + n
        pages = block_tables[i, : -(-total // page_size)]
        k = gather_pages(k_cache, pages, total).float().permute(1, 2, 0)  # [Hk, D, L]
        v = gather_pages(v_cache, pages, total).float().permute(1, 0, 2)  # [Hk, L, D]
        qf = q[start:end].float().view(n, hk, g, d).permute(1, 2, 0, 3)  # [Hk, G, n, D]
        scores = torch.matmul(qf, k[:, None]) * scale  # [Hk, G, n, L]
        query_pos = prefix + torch.arange(n, device=q.device)
        future = torch.arange(total, device=q.device)[None, :] > query_pos[:, None]  # [n, L]
        scores.masked_fill_(future, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v[:, None])  # [Hk, G, n, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)
    return out
