"""Lazy creation of Triton kernels.

Triton reads TRITON_INTERPRET when `@triton.jit` runs, not when a kernel is launched. Kernels in this package
are plain functions wrapped by `lazy_jit`; the wrapper decorates them on first launch (once per interpreter
setting), so tests and debugging sessions can turn the interpreter on after this package was imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl
from triton import knobs

__all__ = ["interpreting", "lazy_jit", "tl", "triton"]


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


class lazy_jit:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._compiled: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        mode = interpreting()
        kernel = self._compiled.get(mode)
        if kernel is None:
            kernel = self._compiled[mode] = triton.jit(self.fn)
        return kernel[grid]


def dot_settings(dtype) -> dict:
    """Constexpr kwargs for kernels that use tl.dot on tensors of `dtype`.

    UPCAST: the interpreter computes bf16 dots wrongly, so there the operands are cast to fp32 first; on a GPU
    fp16/bf16 operands go to the tensor cores as they are (fp32 accumulation), which is where the speed is.
    DOT_PRECISION: fp32 operands use exact fp32 ("ieee") rather than TF32, so fp32 models match the reference.
    """
    import torch

    return {
        "UPCAST": interpreting(),
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }
