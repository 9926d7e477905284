"""Paged attention for the torch backend (CPU): indices planned once per step, one fused SDPA per group.

Contract:
  plan = plan_paged_attention(num_decode, decode_block_tables, decode_context_lens, extend_block_tables,
                              cu_seqlens_q, prefix_lens, page_size, num_kv_heads)    # once per step
  paged_attention_planned(q, k, v, k_cache, v_cache, plan, scale) -> out [T, Hq, D]  # in every layer
      # q [T, Hq, D]; k, v [T, Hk, D] the step's new keys/values, ALREADY stored in the caches (store_kv runs
      # first); the batch layout is ForwardBatch's: decode rows [0, num_decode), then the extend chunks.
Same result as paged_decode_attention_ref + extend_attention_ref (which stay the readable references).

Why: the references derive their gather indices and masks from the page tables in every layer, though they
are the same in all layers, and materialize the [tokens, context] scores. Here the plan holds the indices, and
each layer costs, per group, two index_selects (K and V rows already in the [n, Hk, L, D] layout SDPA wants)
and one scaled_dot_product_attention (torch's fused CPU kernel: online softmax, GQA without repeating K/V).

Decode rows are grouped by context length (sorted, cut where padding to the group's longest context would
cost more than a quarter of extra work), so a ragged batch does not pay its longest context in every row.
An extend chunk with nothing cached before it attends to its own new K/V directly: causal SDPA, no gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# a decode group's padded work (rows x longest context) may exceed its real work by this factor
_PAD_SLACK = 1.25


@dataclass(frozen=True)
class _Group:
    """Decode rows attending over one padded context length, or one extend chunk."""

    rows: Tensor | slice  # decode: [n] row indices into q; extend: the chunk's rows
    kv_rows: Tensor | None  # [n * Hk * L] rows of a cache seen as [slots * Hk, D]; None: the chunk's own K/V
    mask: Tensor | None  # broadcastable to [n, Hq, Lq, L], True = attend; None: every key (decode) / causal
    num_rows: int
    length: int  # L, keys per row


@dataclass(frozen=True)
class AttentionPlan:
    decode: list[_Group]
    extend: list[_Group]


def _kv_rows(slots: Tensor, num_kv_heads: int) -> Tensor:
    """Cache rows (slot * Hk + head) for slots [n, L] -> [n * Hk * L], head-major per sequence."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return (slots.unsqueeze(-2) * num_kv_heads + heads[:, None]).reshape(-1)


def _slots(block_tables: Tensor, length: int, page_size: int) -> Tensor:
    """Slots of positions 0..length-1 for each row of block_tables [n, P] -> [n, length] int64. Positions past
    a row's own pages read a padding entry of its table: valid pages, masked by the caller."""
    pos = torch.arange(length, device=block_tables.device)
    page_idx = (pos // page_size).clamp_(max=block_tables.shape[1] - 1)
    return block_tables.long()[:, page_idx] * page_size + pos % page_size


def _decode_groups(lens: list[int]) -> list[list[int]]:
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= _PAD_SLACK * (real + lens[i]):
            groups[-1].append(i)
            real += lens[i]
        else:
            groups.append([i])
            real = lens[i]
    return groups


def plan_paged_attention(num_decode: int, decode_block_tables: Tensor, decode_context_lens: Tensor,
                         extend_block_tables: Tensor, cu_seqlens_q: Tensor, prefix_lens: Tensor, page_size: int,
                         num_kv_heads: int) -> AttentionPlan:
    device = decode_block_tables.device
    decode = []
    lens = decode_context_lens.tolist()
    for members in (_decode_groups(lens) if num_decode else []):
        length = lens[members[0]]
        rows = torch.tensor(members, device=device)
        slots = _slots(decode_block_tables[rows], length, page_size)
        mask = None
        if any(lens[i] != length for i in members):
            mask = (torch.arange(length, device=device) < decode_context_lens[rows].long()[:, None])[:, None, None]
        decode.append(_Group(rows, _kv_rows(slots, num_kv_heads), mask, len(members), length))
    extend = []
    cu = cu_seqlens_q.tolist()
    for i, prefix in enumerate(prefix_lens.tolist()):
        n = cu[i + 1] - cu[i]
        rows = slice(num_decode + cu[i], num_decode + cu[i + 1])
        if prefix == 0:
            extend.append(_Group(rows, None, None, n, n))
            continue
        total = prefix + n
        slots = _slots(extend_block_tables[i: i + 1, : -(-total // page_size)], total, page_size)
        query_pos = prefix + torch.arange(n, device=device)
        mask = torch.arange(total, device=device)[None, :] <= query_pos[:, None]  # [n, L]
        extend.append(_Group(rows, _kv_rows(slots, num_kv_heads), mask, n, total))
    return AttentionPlan(decode, extend)


def paged_attention_planned(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                            plan: AttentionPlan, scale: float) -> Tensor:
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    gqa = hq != hk
    k_rows, v_rows = k_cache.view(-1, d), v_cache.view(-1, d)
    out = torch.empty_like(q)
    for g in plan.decode:
        kk = k_rows.index_select(0, g.kv_rows).view(g.num_rows, hk, g.length, d).to(q.dtype)
        vv = v_rows.index_select(0, g.kv_rows).view(g.num_rows, hk, g.length, d).to(q.dtype)
        qq = q.index_select(0, g.rows).unsqueeze(2)  # [n, Hq, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, g.rows, o.squeeze(2))
    for g in plan.extend:
        qq = q[g.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if g.kv_rows is None:
            kk, vv = k[g.rows].transpose(0, 1).unsqueeze(0), v[g.rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kk = k_rows.index_select(0, g.kv_rows).view(1, hk, g.length, d).to(q.dtype)
            vv = v_rows.index_select(0, g.kv_rows).view(1, hk, g.length, d).to(q.dtype)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out[g.rows] = o[0].transpose(0, 1)
    return out
