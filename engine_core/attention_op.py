"""Attention as one opaque op, `duet::paged_attention`, that finds its step's batch in a context.

    with attention_op.step(AttentionStep(batch, plan)):          # once per forward (engine_core/model.py)
        out = torch.ops.duet.paged_attention(q, k, v, k_cache, v_cache, scale)   # each layer: [T, Hq * D]

Why: the decoder compiles into one graph (engine_core/cpu_compile.py), and a graph can only take tensors whose
shapes it guards. The batch's page tables and planned indices are not such tensors: their shapes change every
step. So attention is one op the graph calls but does not look into; it stores the layer's new K/V in the
caches and attends through the batch the forward entered here (vLLM's compiled models find their attention
metadata the same way). The op writes the caches without declaring it: only the op itself reads or writes a
layer's cache within a forward, so no other op's order depends on the writes, and a declared mutation would
have the compiler functionalize the writes, which may copy a whole cache.

Registered with torch.library's low-level API (engine_core/cpu_linear.py says why), for every device: CUDA graphs
capture the same op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from engine_core import kernels
from engine_core.forward_batch import ForwardBatch


class AttentionStep(NamedTuple):
    """What attention needs of one forward besides each layer's q/k/v and caches."""

    batch: ForwardBatch
    plan: kernels.AttentionPlan | None  # the torch backend's attention indices, planned once per step


_current = threading.local()  # a worker's steps run on one thread; a thread-local keeps tests' models apart


@contextmanager
def step(attention_step: AttentionStep) -> Iterator[None]:
    """Within it, `duet::paged_attention` attends over `attention_step`'s batch."""
    before = getattr(_current, "step", None)
    _current.step = attention_step
    try:
        yield
    finally:
        _current.step = before


def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: AttentionStep,
                    scale: float) -> Tensor:
    """Attention of every token in the batch over its sequence's pages (its own K/V already stored).

    The batch puts single-token (decode) chunks first: on the Triton backend those rows use the paged decode
    kernel, the rest (prefill chunks) the extend kernel; on the torch backend one planned path does both.
    q: [T, Hq, D], k/v: [T, Hk, D] (the new tokens') -> out [T, Hq, D].
    """
    if step.plan is not None:
        return kernels.paged_attention_planned(q, k, v, k_cache, v_cache, step.plan, scale)
    batch = step.batch
    nd = batch.num_decode_tokens
    if nd == q.shape[0]:
        return kernels.paged_decode_attention(q, k_cache, v_cache, batch.decode_block_tables,
                                              batch.decode_context_lens, scale)
    extend = kernels.extend_attention(q[nd:], k_cache, v_cache, batch.extend_block_tables, batch.cu_seqlens_q,
                                      batch.prefix_lens, scale, max_seqlen_q=batch.max_seqlen_q)
    if nd == 0:
        return extend
    decode = kernels.paged_decode_attention(q[:nd], k_cache, v_cache, batch.decode_block_tables,
                                            batch.decode_context_lens, scale)
    return torch.cat((decode, extend), dim=0)


def _store_and_attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
    s = getattr(_current, "step", None)
    if s is None:
        raise RuntimeError("duet::paged_attention called outside attention_op.step(): no batch to attend over")
    kernels.store_kv(k, v, k_cache, v_cache, s.batch.slot_mapping)
    return paged_attention(q, k, v, k_cache, v_cache, s, scale).reshape(q.shape[0], -1)


_LIBRARY = torch.library.Library("duet", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, float scale) "
                "-> Tensor")
_LIBRARY.impl("paged_attention", _store_and_attend, "CompositeExplicitAutograd")


@torch.library.register_fake("duet::paged_attention")
def _paged_attention_shape(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                           scale: float) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
