"""Lazy creation of Triton kernels.

Triton reads TRITON_INTERPRET when `@triton.jit` runs, not when a kernel is launched. Kernels in this package
are plain functions wrapped by `lazy_jit`; the wrapper decorates them on first launch (once per interpreter
setting), so tests and debugging sessions can turn the interpreter on after this package was imported.
"""

from __future__ import annotations

from typing import Any, Callable

import triton
import triton.language as tl
from triton import knobs

__all__ = ["lazy_jit", "triton", "tl", "interpreting"]


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


class lazy_jit:  # noqa: N801 - used as a decorator, reads like triton.jit
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._compiled: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        mode = interpreting()
        kernel = self._compiled.get(mode)
        if kernel is None:
            kernel = self._compiled[mode] = triton.jit(self.fn)
        return kernel[grid]
