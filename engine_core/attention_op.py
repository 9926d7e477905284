"""Attention as one opaque op, `duet::paged_attention(q, k, v, layer)`, that finds its step in a context.

    with attention_op.step(attentions, inputs, k_caches, v_caches):   # once per forward (engine_core/model.py)
        out = torch.ops.duet.paged_attention(q, k, v, layer)            # in every layer: [T, Hq * D]

Why: the decoder compiles into one graph (engine_core/cpu_compile.py), and a graph can only take tensors whose
shapes it guards. Attention's inputs are not such tensors: the batch's page tables and planned indices change
every step, and the caches are written in place. So attention is one op the graph calls but does not look into;
the op stores the layer's new K/V and attends through the step the forward entered here (vLLM's compiled models
find their attention metadata and caches the same way). The op is registered without declared mutations: only
the op itself reads or writes a layer's cache within a forward, so no other op's order depends on those writes.

Registered with torch.library's low-level API (engine_core/cpu_linear.py says why), for every device: CUDA graphs
capture the same op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine_core.model import Attention, StepInputs


class _Step(NamedTuple):
    attentions: Sequence[Attention]  # each layer's attention module (its scale, head counts)
    inputs: StepInputs
    k_caches: Sequence[Tensor]
    v_caches: Sequence[Tensor]


_current = threading.local()  # a worker's steps run on one thread; a thread-local keeps tests' models apart


@contextmanager
def step(attentions: Sequence[Attention], inputs: StepInputs, k_caches: Sequence[Tensor],
         v_caches: Sequence[Tensor]) -> Iterator[None]:
    """Within it, `duet::paged_attention` of layer i attends over k_caches[i] / v_caches[i] for `inputs`' batch."""
    before = getattr(_current, "step", None)
    _current.step = _Step(attentions, inputs, k_caches, v_caches)
    try:
        yield
    finally:
        _current.step = before


def _paged_attention(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    s = getattr(_current, "step", None)
    if s is None:
        raise RuntimeError("duet::paged_attention called outside attention_op.step(): no batch or caches to use")
    return s.attentions[layer].attend(q, k, v, s.inputs, s.k_caches[layer], s.v_caches[layer])


_LIBRARY = torch.library.Library("duet", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_LIBRARY.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("duet::paged_attention")
def _paged_attention_shape(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
