"""Paged decode attention: one query token per sequence against its KV pages.

Contract (both implementations):
  paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out [B, Hq, D] (q's dtype)
      # q [B, Hq, D]; k_cache, v_cache [num_pages, page_size, Hk, D]; Hq % Hk == 0 (GQA/MQA by head grouping:
      # query head h reads KV head h // (Hq // Hk)); block_tables [B, max_pages] int32, row b lists the pages of
      # sequence b in order (entries past its last page are ignored); context_lens [B] int32, each >= 1.
The softmax and both products are computed in fp32.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from engine_core.kernels._jit import dot_settings, interpreting, lazy_jit, tl, triton
from engine_core.kernels.bounds import check_page_tables, checks_apply


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


def page_slots(pages: Tensor, length: int, page_size: int) -> Tensor:
    """Cache slots (page * page_size + offset) of positions 0 .. length-1 of sequences whose page lists are
    `pages` [..., P] (P * page_size >= length) -> [..., length] int64."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.long()[..., None] * page_size + offsets).flatten(-2)[..., :length]


def gather_heads(cache: Tensor, slots: Tensor) -> Tensor:
    """Rows `slots` [..., L] of cache [num_pages, page_size, Hk, D], head-major: -> [..., Hk, L, D] (contiguous).

    One index_select over the cache seen as [slots * Hk, D] writes the layout the matmuls want directly, so
    nothing is copied a second time (a permute of [..., L, Hk, D] would be, inside torch.matmul)."""
    hk, d = cache.shape[2], cache.shape[3]
    heads = torch.arange(hk, device=slots.device)
    rows = slots.unsqueeze(-2) * hk + heads[:, None]  # [..., Hk, L]
    # clamp: block-table entries past a sequence's last page are unspecified; they only feed masked positions
    rows = rows.clamp_(0, cache.shape[0] * cache.shape[1] * hk - 1)
    return cache.reshape(-1, d).index_select(0, rows.reshape(-1)).view(*rows.shape, d)


# the reference attends in blocks of this many context positions: padding each sequence to a whole block
# instead of to the batch's longest context (which wastes ~40% of the work on ragged batches), with few
# enough blocks that the per-block matmuls stay cheap
_REF_BLOCK = 64


def paged_decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    check_paged_args("paged_decode_attention", q, k_cache, v_cache, block_tables)
    b, hq, d = q.shape
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
    g = hq // hk
    if b == 0:
        return torch.empty_like(q)
    # On CPU this reference is the production path, so it is written for speed: every sequence's context is
    # cut into blocks, all blocks of the batch are read with one gather and scored by two batched matmuls,
    # and the softmax spans each sequence's blocks (its max by scatter_reduce, its sums by index_add).
    dev = q.device
    lens = context_lens.to(dev).long()
    num_blocks = (lens + _REF_BLOCK - 1) // _REF_BLOCK  # [B]
    owner = torch.repeat_interleave(torch.arange(b, device=dev), num_blocks)  # [N]: the sequence of each block
    first = num_blocks.cumsum(0) - num_blocks  # [B]: each sequence's first block
    block_start = (torch.arange(owner.shape[0], device=dev) - first[owner]) * _REF_BLOCK
    pos = block_start[:, None] + torch.arange(_REF_BLOCK, device=dev)  # [N, BLOCK] positions in the sequence
    # positions past a sequence's end may fall past its pages: clamp (they are masked below)
    pages = block_tables.long()[owner[:, None], (pos // page_size).clamp_(max=block_tables.shape[1] - 1)]
    slots = pages * page_size + pos % page_size
    k = gather_heads(k_cache, slots).float()  # [N, Hk, BLOCK, D]
    v = gather_heads(v_cache, slots).float()  # [N, Hk, BLOCK, D]
    # GQA: the G query heads of one KV head are rows of one matmul, so K/V are never repeated per query head
    qf = q.float().view(b, hk, g, d)[owner]  # [N, Hk, G, D]
    scores = torch.matmul(qf, k.transpose(-1, -2)).mul_(scale)  # [N, Hk, G, BLOCK]
    scores.masked_fill_((pos >= lens[owner, None])[:, None, None, :], float("-inf"))
    block_max = scores.amax(-1)  # [N, Hk, G], finite: every block holds at least one real position
    seq_max = torch.full((b, hk, g), float("-inf"), device=dev).scatter_reduce_(
        0, owner[:, None, None].expand_as(block_max), block_max, "amax")
    p = torch.exp(scores - seq_max[owner][..., None])
    denom = torch.zeros((b, hk, g), device=dev).index_add_(0, owner, p.sum(-1))
    out = torch.zeros((b, hk, g, d), device=dev).index_add_(0, owner, torch.matmul(p, v))  # [B, Hk, G, D]
    return (out / denom[..., None]).reshape(b, hq, d).to(q.dtype)


@lazy_jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_cp, stride_cs, stride_ch,
    stride_bt,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    qk_scale, head_dim, group, tokens_per_split,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # program (b, kv_head, split): the `group` query heads that share kv_head, over one slice of the context.
    # Loading K/V once for the whole group is what makes GQA decode cheap; the group is padded to 16 rows
    # because tl.dot needs it.
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    # finite start value: a fully masked block then gives alpha = 1, p = 0 instead of NaN
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tok in range(start, end, BLOCK_N):
        pos = tok + n
        n_mask = pos < end
        page = tl.load(bt_ptr + b * stride_bt + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = page * stride_cp + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch  # [N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty split (past the end of a short sequence) reports lse = -inf and weighs nothing in the reduce
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@lazy_jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # program (b, q_head): merge the per-split softmax results, weighting each by exp2(lse - max lse)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(s_mask & (lse > float("-inf")), w, 0.0)
    parts = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(q: Tensor, num_kv_heads: int, max_context: int, block_n: int) -> int:
    if interpreting() or not q.is_cuda:
        # enough to exercise the reduce, few enough programs for the slow interpreter
        return 2 if max_context > block_n else 1
    # flash-decoding: split long contexts until there are a few programs per SM
    sms = _sm_count(q.device.index or 0)
    want = triton.cdiv(4 * sms, q.shape[0] * num_kv_heads)
    return max(1, min(want, max_context // 256, 64))


def paged_decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> Tensor:
    """Split-KV (flash-decoding) paged attention; `num_splits` overrides the heuristic (tests, tuning)."""
    check_paged_args("paged_decode_attention", q, k_cache, v_cache, block_tables)
    b, hq, d = q.shape
    _, page_size, hk, _ = k_cache.shape
    if context_lens.shape != (b,) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"paged_decode_attention: context_lens must be [{b}] int32, got {context_lens.dtype} "
            f"{tuple(context_lens.shape)}"
        )
    if block_tables.shape[0] != b:
        raise ValueError(f"paged_decode_attention: block_tables has {block_tables.shape[0]} rows for batch {b}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}) != 1:
        raise ValueError("paged_decode_attention: all tensors must be on one device")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode_attention: q and the caches need a contiguous last dim, caches equal strides")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if checks_apply(q):
        check_page_tables("paged_decode_attention", block_tables, context_lens, page_size, k_cache.shape[0])
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    interp = interpreting()
    block_n = 16 if interp else 64
    # the block table's width bounds every context: no device->host sync needed to size the grid
    max_context = block_tables.shape[1] * page_size
    splits = num_splits or _num_splits(q, hk, max_context, block_n)
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    splits = triton.cdiv(max_context, tokens_per_split)
    part_out = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    block_d = max(triton.next_power_of_2(d), 16)
    _decode_split_kernel[(b, hk, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        scale * _LOG2E, d, hq // hk, tokens_per_split,
        PAGE_SIZE=page_size, BLOCK_G=max(triton.next_power_of_2(hq // hk), 16), BLOCK_N=block_n,
        BLOCK_D=block_d, num_warps=4, num_stages=2, **dot_settings(q.dtype),
    )
    _decode_reduce_kernel[(b, hq)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        d, splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4,
    )
    return out


_LOG2E = 1.4426950408889634
