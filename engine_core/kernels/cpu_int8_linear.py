"""int8 weight-only matmul on CPU with bf16 dot products (csrc/int8_linear.c).

    vector_path() -> bool                         # the library is built with its AVX512_BF16 loop
    pack_int8(q [N, K] int8) -> Tensor            # the kernel's panel layout, once at load
    int8_linear_native(x, packed, scale, bias, out_features) -> y   # y = bf16(x) q^T * scale + bias, fp32

What it wins: on a CPU with AVX512_BF16 one instruction does two multiply-adds per fp32 lane, so the int8 weights,
widened to bf16 in registers (exactly: |q| <= 127), multiply at twice fp32's rate while a step reads a quarter of
fp32's bytes; torch's `_weight_int8pack_mm` does neither (docs/benchmarks.md). cpu_linear.Int8Linear takes this
kernel where `vector_path()` holds; elsewhere the library's portable loop computes the same sums (the tests hold
both to one reference) but slower than torch's kernel, which stays. DUET_NATIVE_CPU_INT8=0 keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from engine_core.kernels.cpu_native import _CSRC, build_and_load

PANEL = 16  # output columns per panel (one 512-bit vector of fp32 sums); must match csrc/int8_linear.c
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("DUET_NATIVE_CPU_INT8", "1") == "0":
        return None
    lib = build_and_load("cpu_int8_linear", [_CSRC / "int8_linear.c"], "int8 matmuls use torch's kernel")
    if lib is None:
        return None
    lib.int8_linear_f32.restype = ctypes.c_int
    lib.int8_linear_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, ctypes.c_int]
    lib.int8_linear_vector_path.restype, lib.int8_linear_vector_path.argtypes = ctypes.c_int, []
    return lib


def vector_path() -> bool:
    lib = library()
    return lib is not None and lib.int8_linear_vector_path() == 1


def pack_int8(q: Tensor) -> Tensor:
    """q [N, K] int8 -> [ceil(N / 16), ceil(K / 2), 16, 2]: per panel of 16 output rows, each pair of input
    columns of those rows side by side (what one widened vector holds); zero weights pad N and K."""
    n, k = q.shape
    q = torch.nn.functional.pad(q, (0, k % 2, 0, -n % PANEL))
    return q.view(q.shape[0] // PANEL, PANEL, q.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def int8_linear_native(x: Tensor, packed: Tensor, scale: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x [..., K] fp32 -> [..., out_features] fp32; `packed` from pack_int8, scale [N] and bias [N] fp32
    contiguous. Same result as (bf16(x) as fp32) @ q^T * scale + bias, summed in fp32. Also the op
    `torch.ops.duet.int8_linear`, which a compiled graph calls without tracing into ctypes."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and packed.dtype == torch.int8
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0]:
        rc = lib.int8_linear_f32(rows.data_ptr(), rows.shape[0], k, rows.stride(0), packed.data_ptr(),
                                 scale.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                                 out_features, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"int8 matmul: no memory for {rows.shape[0]} x {k} bf16 activations")
    return y.reshape(*x.shape[:-1], out_features)


# registered with torch.library's low-level API (as cpu_linear's duet::cpu_linear, for the same per-call cost), so
# a compiled decoder (engine_core/cpu_compile.py) keeps one graph for every row count around an opaque call
_LIBRARY = torch.library.Library("duet", "FRAGMENT")
_LIBRARY.define("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl("int8_linear", int8_linear_native, "CPU")


@torch.library.register_fake("duet::int8_linear")
def _int8_linear_shape(x: Tensor, packed: Tensor, scale: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
