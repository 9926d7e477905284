"""Paged attention of one decoder layer as one opaque op, so that a whole decoder layer is one compiled graph.

`duet::layer_attention(q, k, v, scale)` stores the new tokens' K/V in their page slots and attends over each
sequence's pages (the native or Triton kernels, engine_core.kernels). What it reads besides q/k/v — the step's
page tables, slot mapping, attention plan and the layer's K/V caches — it takes from the step context that
`DecoderModel.forward` opens around the layers (`step_context`), as vLLM's attention op takes its metadata from
its forward context. It finds its layer by counting: every layer calls it once, in order (each call's input is
the previous layer's output), and the forward checks the count. So a traced layer holds no page table, cache or
layer index, and torch.compile (engine_core/cpu_compile.py) traces one layer into a graph that every layer and
every step of every shape runs.

Writing the caches is the op's side effect, not a declared mutation: declared, the compiler would functionalize
the caches (copy them) around each call. Nothing else in a step reads them, and each layer's call depends on
the one before through its input, so no reordering can move a write past its read.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from engine_core import kernels
from engine_core.forward_batch import ForwardBatch


class StepInputs(NamedTuple):
    """What every layer of one forward needs besides its hidden states and its caches."""

    positions: Tensor  # [T] int64
    batch: ForwardBatch
    rope_cache: Tensor
    attn_plan: kernels.AttentionPlan | None  # the torch backend's attention indices, planned once per step


def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs,
                    scale: float) -> Tensor:
    """Attention of every token in the batch over its sequence's pages (its own K/V already stored).

    The batch puts single-token (decode) chunks first: on the Triton backend those rows use the paged decode
    kernel, the rest (prefill chunks) the extend kernel; on the torch backend one planned path does both.
    q: [T, Hq, D], k/v: [T, Hk, D] (the new tokens') -> out [T, Hq, D].
    """
    if step.attn_plan is not None:
        return kernels.paged_attention_planned(q, k, v, k_cache, v_cache, step.attn_plan, scale)
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


class _Step:
    """One forward's inputs and caches, and how many layers have attended so far."""

    def __init__(self, inputs: StepInputs, k_caches: list[Tensor], v_caches: list[Tensor]) -> None:
        self.inputs, self.k_caches, self.v_caches = inputs, k_caches, v_caches
        self.layers_done = 0


_current = threading.local()  # .step: the _Step of the forward running on this thread


@contextmanager
def step_context(inputs: StepInputs, k_caches: list[Tensor], v_caches: list[Tensor]):
    """Within it, `duet::layer_attention` on this thread attends for this step over these caches."""
    before = getattr(_current, "step", None)
    _current.step = step = _Step(inputs, k_caches, v_caches)
    try:
        yield step
    finally:
        _current.step = before


def _layer_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    step = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError("duet::layer_attention runs only inside DecoderModel.forward (no step context is open)")
    layer, step.layers_done = step.layers_done, step.layers_done + 1
    k_cache, v_cache = step.k_caches[layer], step.v_caches[layer]
    kernels.store_kv(k, v, k_cache, v_cache, step.inputs.batch.slot_mapping)
    return paged_attention(q, k, v, k_cache, v_cache, step.inputs, scale).reshape(q.shape[0], -1)


# the low-level registration, as duet::cpu_linear's (engine_core/cpu_linear.py): @custom_op's wrapper checks its
# arguments on every call. One implementation for every device (CompositeExplicitAutograd): the kernels pick theirs
_LIBRARY = torch.library.Library("duet", "FRAGMENT")
_LIBRARY.define("layer_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")
_LIBRARY.impl("layer_attention", _layer_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("duet::layer_attention")
def _layer_attention_shape(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def layer_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """[T, Hq * D]: the next layer's attention in the step opened by `step_context` (its K/V stored first)."""
    return torch.ops.duet.layer_attention(q, k, v, scale)
