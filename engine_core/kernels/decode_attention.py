"""Paged decode attention: one query token per sequence against its KV pages.

Contract (both implementations):
  paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out [B, Hq, D] (q's dtype)
      # q [B, Hq, D]; k_cache, v_cache [num_pages, page_size, Hk, D]; Hq % Hk == 0 (GQA/MQA by head grouping:
      # query head h reads KV head h // (Hq // Hk)); block_tables [B, max_pages] int32, row b lists the pages of
      # sequence b in order (entries past its last page are ignored); context_lens [B] int32, each >= 1.
The softmax and both products are computed in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton


def check_paged_args(name: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor) -> None:
    """Shape/dtype checks shared by the decode and extend attention entry points."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [tokens, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{name}: k_cache and v_cache must both be [num_pages, page_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"{name}: head_dim of q ({d}) != head_dim of the cache ({k_cache.shape[3]})")
    if hq % hk:
        raise ValueError(f"{name}: num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: block_tables must be a 2-D int32 tensor, got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(f"{name}: q must be a floating tensor, got {q.dtype}")


def gather_pages(cache: Tensor, pages: Tensor, length: int) -> Tensor:
    """The first `length` cached rows of sequences whose page lists are `pages` [..., P] -> [..., length, Hk, D]."""
    page_size, hk, d = cache.shape[1:]
    rows = cache[pages.long().clamp(0, cache.shape[0] - 1)]  # [..., P, page_size, Hk, D]
    return rows.reshape(*pages.shape[:-1], pages.shape[-1] * page_size, hk, d)[..., :length, :, :]


def paged_decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    check_paged_args("paged_decode_attention", q, k_cache, v_cache, block_tables)
    b, hq, d = q.shape
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
    if b == 0:
        return torch.empty_like(q)
    # pad every sequence to the longest context in the batch and mask the tail
    max_len = int(context_lens.max())
    num_pages = -(-max_len // page_size)
    pages = block_tables[:, :num_pages]
    k = gather_pages(k_cache, pages, max_len).float().permute(0, 2, 3, 1)  # [B, Hk, D, L]
    v = gather_pages(v_cache, pages, max_len).float().permute(0, 2, 1, 3)  # [B, Hk, L, D]
    qf = q.float().view(b, hk, hq // hk, d)  # [B, Hk, G, D]
    scores = torch.matmul(qf, k) * scale  # [B, Hk, G, L]
    pad = torch.arange(max_len, device=q.device)[None, :] >= context_lens.to(q.device).long()[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, Hk, G, D]
    return out.reshape(b, hq, d).to(q.dtype)
