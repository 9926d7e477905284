"""The kernel package: every op the models need beyond plain matmuls, and all attention math.

Each op lives in its own module as a Triton kernel + launcher (`<op>_triton`) beside a torch reference
(`<op>_ref`) with the same signature. The functions exported here dispatch between them:

  - CUDA tensors run the Triton kernel, CPU tensors run the torch reference (DUET_KERNELS unset or "auto");
  - DUET_KERNELS=torch forces the reference everywhere (debugging a suspected kernel bug on GPU);
  - DUET_KERNELS=triton forces the Triton kernels everywhere; on CPU tensors this needs TRITON_INTERPRET=1
    (Triton's interpreter, slow, used by the tests to prove the kernels without a GPU).

The variable is read on every call, so a test may set it with monkeypatch. Contracts (shapes, dtypes) are in
each op's module docstring.

Attention on the torch backend has a faster path than the two references: `plan_paged_attention` once per step
and `paged_attention_planned` in every layer (cpu_attention.py); the model takes it wherever
`kernel_backend` says "torch". In fp32 its decode rows and prefill chunks run small C kernels that read K/V in
place through the page table (cpu_paged_decode.py, cpu_paged_extend.py; built once per machine by cpu_native.py)
when a C compiler is there.
"""

from __future__ import annotations

import os

from torch import Tensor

from engine_core.kernels import activation as _act
from engine_core.kernels import decode_attention as _decode
from engine_core.kernels import extend_attention as _extend
from engine_core.kernels import rms_norm as _norm
from engine_core.kernels import rope as _rope
from engine_core.kernels import store_kv as _store
from engine_core.kernels._jit import interpreting
from engine_core.kernels.cpu_attention import AttentionPlan, paged_attention_planned, plan_paged_attention
from engine_core.kernels.cpu_native import native_applies
from engine_core.kernels.rope import build_rope_cache

__all__ = [
    "AttentionPlan",
    "apply_rope",
    "build_rope_cache",
    "extend_attention",
    "fused_add_rms_norm",
    "kernel_backend",
    "native_applies",
    "paged_attention_planned",
    "paged_decode_attention",
    "plan_paged_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]

_BACKENDS = ("auto", "triton", "torch")


def kernel_backend(t: Tensor) -> str:
    """"triton" or "torch": which implementation runs for tensors on t's device under DUET_KERNELS."""
    mode = os.environ.get("DUET_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _BACKENDS:
        raise ValueError(f"DUET_KERNELS must be one of {', '.join(_BACKENDS)}; got {mode!r}")
    if mode == "auto":
        return "triton" if t.is_cuda else "torch"
    if mode == "triton" and not t.is_cuda and not interpreting():
        raise ValueError("DUET_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    return mode


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if kernel_backend(x) == "triton":
        return _norm.rms_norm_triton(x, weight, eps)
    return _norm.rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if kernel_backend(x) == "triton":
        return _norm.fused_add_rms_norm_triton(x, residual, weight, eps)
    return _norm.fused_add_rms_norm_ref(x, residual, weight, eps)


def apply_rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    if kernel_backend(q) == "triton":
        return _rope.apply_rope_triton(q, k, positions, cos_sin_cache)
    return _rope.apply_rope_ref(q, k, positions, cos_sin_cache)


def silu_and_mul(x: Tensor) -> Tensor:
    if kernel_backend(x) == "triton":
        return _act.silu_and_mul_triton(x)
    return _act.silu_and_mul_ref(x)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    if kernel_backend(k) == "triton":
        _store.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        _store.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    if kernel_backend(q) == "triton":
        return _decode.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _decode.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


def extend_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    prefix_lens: Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
) -> Tensor:
    """`max_seqlen_q` (longest new chunk, optional) spares the Triton path a device->host sync."""
    if kernel_backend(q) == "triton":
        return _extend.extend_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale, max_seqlen_q=max_seqlen_q
        )
    return _extend.extend_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale)
