"""Paged attention for the torch backend (CPU): indices planned once per step, one fused SDPA per group.

Contract:
  plan = plan_paged_attention(num_decode, decode_block_tables, decode_context_lens, extend_block_tables,
                              cu_seqlens_q, prefix_lens, page_size)    # once per step
  paged_attention_planned(q, k, v, k_cache, v_cache, plan, scale) -> out [T, Hq, D]  # in every layer
      # q [T, Hq, D]; k, v [T, Hk, D] the step's new keys/values, ALREADY stored in the caches (store_kv runs
      # first); the batch layout is ForwardBatch's: decode rows [0, num_decode), then the extend chunks.
Same result as paged_decode_attention_ref + extend_attention_ref (which stay the readable references).

Why: the references derive their gather indices and masks from the page tables in every layer, though they
are the same in all layers, gather K/V token row by token row, and materialize the [tokens, context] scores.
Here the plan holds the page lists and masks, and each layer costs, per group, two index_selects of whole pages
(a page is one contiguous block of page_size * Hk * D values: a memcpy, a quarter cheaper in CPU time than
gathering 64-value rows on the SmolLM2 shape) and one scaled_dot_product_attention (torch's fused CPU kernel:
online softmax, GQA without repeating K/V) over the gathered pages seen as [n, Hk, L, D].

Decode rows are grouped by context length (sorted, cut where padding to the group's longest context would
cost more than a quarter of extra work), so a ragged batch does not pay its longest context in every row.
An extend chunk with nothing cached before it attends to its own new K/V directly: causal SDPA, no gather.

With `native=True` (the caller checked cpu_native.native_applies: CPU, fp32 or bf16, a C compiler) the decode rows
and the extend chunks go to the native kernels instead (cpu_paged_decode.py, cpu_paged_extend.py), which read the
pages in place; the plan then holds only their int32 inputs. The kernels compute in fp32: a bf16 model's queries
are widened for them and their outputs narrowed back, once per layer (K and V stay bf16 in the pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine_core.kernels.cpu_paged_decode import paged_decode_native
from engine_core.kernels.cpu_paged_extend import paged_extend_native

# a decode group's padded work (rows x longest context) may exceed its real work by this factor
_PAD_SLACK = 1.25


@dataclass(frozen=True)
class _Group:
    """Decode rows attending over one padded context length, or one extend chunk."""

    rows: Tensor | slice  # decode: [n] row indices into q; extend: the chunk's rows
    pages: Tensor | None  # [n * pages per row] page ids, row after row; None: attend to the chunk's own K/V
    mask: Tensor | None  # broadcastable to [n, Hq, Lq, L], True = attend; None: every key / causal
    length: int  # L, keys per row: pages * page_size (the tail of the last page is masked)


@dataclass(frozen=True)
class _NativeDecode:
    """The decode rows' inputs to the native kernel (cpu_paged_decode.py), which reads pages in place."""

    block_tables: Tensor  # [num_decode, P] int32, contiguous
    context_lens: Tensor  # [num_decode] int32, contiguous
    max_context: int


@dataclass(frozen=True)
class _NativeExtend:
    """The extend chunks' inputs to the native kernel (cpu_paged_extend.py), all int32 and contiguous."""

    block_tables: Tensor  # [chunks, P]
    q_start: Tensor  # [chunks] each chunk's first row in q
    new_lens: Tensor  # [chunks]
    prefix_lens: Tensor  # [chunks]


@dataclass(frozen=True)
class AttentionPlan:
    decode: list[_Group]
    extend: list[_Group]
    native: _NativeDecode | None = None  # set: decode rows go to the native kernel, `decode` is empty
    native_extend: _NativeExtend | None = None  # set: extend chunks go to the native kernel, `extend` is empty


def _pages(block_tables: Tensor, num_pages: int) -> Tensor:
    """The first num_pages entries of each row of block_tables [n, P] -> [n * num_pages] int64. Entries past a
    row's own pages are padding of its table (valid page ids): what they hold is masked by the caller."""
    return block_tables[:, :num_pages].long().reshape(-1)


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
                         extend_block_tables: Tensor, cu_seqlens_q: Tensor, prefix_lens: Tensor,
                         page_size: int, native: bool = False) -> AttentionPlan:
    """native: decode rows and extend chunks run the native kernels (the caller checked native_applies)."""
    device = decode_block_tables.device
    decode = []
    lens = decode_context_lens.tolist()
    native_decode = None
    if native and num_decode:
        native_decode = _NativeDecode(decode_block_tables[:num_decode].to(torch.int32).contiguous(),
                               decode_context_lens[:num_decode].to(torch.int32).contiguous(), max(lens))
    for members in (_decode_groups(lens) if num_decode and native_decode is None else []):
        num_pages = -(-lens[members[0]] // page_size)
        rows = torch.tensor(members, device=device)
        length = num_pages * page_size
        mask = None
        if any(lens[i] != length for i in members):
            mask = (torch.arange(length, device=device) < decode_context_lens[rows].long()[:, None])[:, None, None]
        decode.append(_Group(rows, _pages(decode_block_tables[rows], num_pages), mask, length))
    extend = []
    cu = cu_seqlens_q.tolist()
    if native and len(cu) > 1:
        i32 = torch.int32
        return AttentionPlan(decode, [], native_decode, _NativeExtend(
            extend_block_tables.to(i32).contiguous(), (cu_seqlens_q[:-1] + num_decode).to(i32).contiguous(),
            (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(i32).contiguous(), prefix_lens.to(i32).contiguous()))
    for i, prefix in enumerate(prefix_lens.tolist()):
        n = cu[i + 1] - cu[i]
        rows = slice(num_decode + cu[i], num_decode + cu[i + 1])
        if prefix == 0:
            extend.append(_Group(rows, None, None, n))
            continue
        num_pages = -(-(prefix + n) // page_size)
        length = num_pages * page_size
        query_pos = prefix + torch.arange(n, device=device)
        mask = torch.arange(length, device=device)[None, :] <= query_pos[:, None]  # [n, L]: causal, offset
        extend.append(_Group(rows, _pages(extend_block_tables[i: i + 1], num_pages), mask, length))
    return AttentionPlan(decode, extend, native_decode)


def _gather(cache: Tensor, group: _Group, dtype: torch.dtype) -> Tensor:
    """The group's pages of cache [num_pages, page_size, Hk, D] as [b, Hk, L, D] (a view of one copy), b the
    sequences whose pages these are: the decode rows, or the one sequence of an extend chunk."""
    hk, d = cache.shape[2], cache.shape[3]
    pages = cache.view(cache.shape[0], -1).index_select(0, group.pages)
    return pages.view(-1, group.length, hk, d).transpose(1, 2).to(dtype)


def paged_attention_planned(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                            plan: AttentionPlan, scale: float) -> Tensor:
    if plan.native is not None or plan.native_extend is not None:
        return _native(q, k_cache, v_cache, plan, scale)
    gqa = q.shape[1] != k_cache.shape[2]
    out = torch.empty_like(q)
    for g in plan.decode:
        qq = q.index_select(0, g.rows).unsqueeze(2)  # [n, Hq, 1, D]
        o = F.scaled_dot_product_attention(qq, _gather(k_cache, g, q.dtype), _gather(v_cache, g, q.dtype),
                                           attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, g.rows, o.squeeze(2))
    for g in plan.extend:
        qq = q[g.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if g.pages is None:
            kk, vv = k[g.rows].transpose(0, 1).unsqueeze(0), v[g.rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qq, _gather(k_cache, g, q.dtype), _gather(v_cache, g, q.dtype),
                                               attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out[g.rows] = o[0].transpose(0, 1)
    return out


def _native(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, scale: float) -> Tensor:
    """The plan's rows on the native kernels (every row: a native plan leaves no group to the torch path)."""
    q32 = q.float().contiguous()  # a copy in bf16, the tensor itself in fp32
    if plan.native_extend is None:  # decode rows only (most steps): the kernel's output is the whole answer
        n = plan.native
        out = paged_decode_native(q32, k_cache, v_cache, n.block_tables, n.context_lens, scale, n.max_context)
        return out.to(q.dtype)
    out = torch.empty_like(q32)
    if plan.native is not None:
        n = plan.native
        rows = n.context_lens.shape[0]
        out[:rows] = paged_decode_native(q32[:rows], k_cache, v_cache, n.block_tables, n.context_lens, scale,
                                         n.max_context)
    if plan.native_extend is not None:
        e = plan.native_extend
        paged_extend_native(q32, k_cache, v_cache, e.block_tables, e.q_start, e.new_lens, e.prefix_lens, out, scale)
    return out.to(q.dtype)
