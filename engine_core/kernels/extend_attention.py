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

from engine_core.kernels._jit import dot_settings, interpreting, lazy_jit, tl, triton
from engine_core.kernels.bounds import check_page_tables, check_query_ranges, checks_apply, tile_problem
from engine_core.kernels.decode_attention import check_paged_args, gather_heads, page_slots


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
    _, hq, d = q.shape
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
        slots = page_slots(block_tables[i, : -(-total // page_size)], total, page_size)  # [L]
        k = gather_heads(k_cache, slots).float()  # [Hk, L, D]
        v = gather_heads(v_cache, slots).float()  # [Hk, L, D]
        qf = q[start:end].float().view(n, hk, g, d).permute(1, 2, 0, 3)  # [Hk, G, n, D]
        scores = torch.matmul(qf, k[:, None].transpose(-1, -2)).mul_(scale)  # [Hk, G, n, L]
        query_pos = prefix + torch.arange(n, device=q.device)
        future = torch.arange(total, device=q.device)[None, :] > query_pos[:, None]  # [n, L]
        scores.masked_fill_(future, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v[:, None])  # [Hk, G, n, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)
    return out


@lazy_jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_ptr, prefix_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_cp, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    qk_scale, head_dim, group,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # program (query block, sequence, query head): flash attention over the sequence's pages, online softmax.
    # The last query blocks see the most keys: they are started first, so the grid ends evenly
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    kv_head = h // group
    q_start = tl.load(cu_ptr + b)
    num_new = tl.load(cu_ptr + b + 1) - q_start
    prefix = tl.load(prefix_ptr + b)

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < num_new
    d_mask = d < head_dim
    q = tl.load(q_ptr + (q_start + m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + m  # absolute positions of this block's queries

    # keys up to the block's last query; a block past the sequence's end reads nothing and stores nothing
    hi = tl.minimum(prefix + (m_block + 1) * BLOCK_M, prefix + num_new)
    hi = tl.where(m_block * BLOCK_M < num_new, hi, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys before the block's first query are visible to all its queries: phase 0 runs them without the causal
    # mask (1.3x the rate of masking every block, measured on an H200); phase 1 runs the rest, masked
    full = tl.where(m_block * BLOCK_M < num_new, prefix + m_block * BLOCK_M, 0) // BLOCK_N * BLOCK_N
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else full
        end = full if phase == 0 else hi
        for start in range(lo, end, BLOCK_N):
            k_pos = start + n
            n_mask = k_pos < end
            if phase == 0:
                page = tl.load(bt_ptr + b * stride_bt + k_pos // PAGE_SIZE).to(tl.int64)
            else:
                page = tl.load(bt_ptr + b * stride_bt + k_pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            row = page * stride_cp + (k_pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch  # [N]
            # K read as rows (as stored) and transposed in registers: 1.25x the rate of reading it transposed
            k = tl.trans(tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                                 other=0.0))
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
            if phase == 1:
                visible = (k_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    tile: tuple | None = None,
) -> Tensor:
    """Flash attention over paged K/V. `max_seqlen_q` (the longest new chunk) sizes the grid; when omitted it
    is read from cu_seqlens_q, which costs a device->host sync on a GPU. `tile` = (BLOCK_M, BLOCK_N, warps, stages)
    overrides the GPU tiles (tests, `python -m engine_core.kernels.tune extend`); one the kernel cannot run is
    rejected. Page tables and query ranges are checked as engine_core/kernels/bounds.py says."""
    check_paged_args("extend_attention", q, k_cache, v_cache, block_tables)
    check_extend_args(q, block_tables, cu_seqlens_q, prefix_lens)
    t, hq, d = q.shape
    _, page_size, hk, _ = k_cache.shape
    b = prefix_lens.shape[0]
    if len({x.device for x in (q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens)}) != 1:
        raise ValueError("extend_attention: all tensors must be on one device")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("extend_attention: q and the caches need a contiguous last dim, caches equal strides")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if checks_apply(q):
        check_query_ranges("extend_attention", cu_seqlens_q, t, max_seqlen_q)
        check_page_tables("extend_attention", block_tables, prefix_lens.long() + cu_seqlens_q[1:] - cu_seqlens_q[:-1],
                          page_size, k_cache.shape[0])
    block_d = max(triton.next_power_of_2(d), 16)
    block_m, block_n, warps, stages = tile or default_tile()
    if (problem := tile_problem(block_m, block_n, warps, stages)) is not None:
        raise ValueError(f"extend_attention: tile {tuple(tile)} cannot run: {problem}")
    grid = (triton.cdiv(max_seqlen_q, block_m), b, hq)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * _LOG2E, d, hq // hk,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps, num_stages=stages, **dot_settings(q.dtype),
    )
    return out


# (BLOCK_M, BLOCK_N, warps, stages) when no tile is given. GPU: the fastest measured on an H200 (docs/benchmarks.md;
# `python -m engine_core.kernels.tune extend` sweeps them); the interpreter: small tiles, quick to interpret
GPU_TILE = (128, 128, 8, 2)
INTERPRETER_TILE = (16, 16, 4, 2)


def default_tile() -> tuple[int, int, int, int]:
    return INTERPRETER_TILE if interpreting() else GPU_TILE


_LOG2E = 1.4426950408889634
