"""int8 weights with one scale per group of input columns (GGUF Q8_0's blocks), fp32 math (csrc/int8_grouped.c).

    library() -> ctypes.CDLL | None
    vector_path() -> bool                                   # the library is built with its AVX2/FMA loop
    pack_grouped(q [N, K] int8, scale [N, K / G]) -> (packed, packed_scales)   # the kernel's layout, once at load
    int8_grouped_native(x, packed, packed_scales, group, bias, out_features) -> y   # y = x (q * s)^T + bias, fp32

What it is for: serving a Q8_0 file's int8 blocks as they are (cpu_linear.GroupedInt8Linear), a quarter of fp32's
weight bytes, with no second rounding of the weights. Up to 64 rows (decode) the weights are dequantized in
registers only; a bigger call (prefill) dequantizes its one matrix for the call and runs MKL's GEMM on it, faster
than the kernel's tiles there. Either way the result is the fp32 product with the dequantized matrix up to the
order of the sums (q * s is exact in fp32). It needs only AVX2 and FMA; the library's portable loop computes the
same sums elsewhere, slowly (the tests hold both to one reference). DUET_NATIVE_CPU_INT8=0 turns it off, as it does the per-channel kernel; GroupedInt8Linear then
dequantizes each call's weight.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from engine_core.kernels.cpu_native import _CSRC, build_and_load

PANEL = 8  # output columns per panel (one 256-bit vector of fp32 sums); must match csrc/int8_grouped.c
# above this many rows a call dequantizes its matrix for MKL's GEMM: the kernel's tiles made a 4 x 512-token prefill
# step 1.5x slower than fp32 on a Zen 3 (docs/benchmarks.md); the weights stay int8 between calls
KERNEL_MAX_ROWS = 64
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("DUET_NATIVE_CPU_INT8", "1") == "0":
        return None
    lib = build_and_load("cpu_int8_grouped", [_CSRC / "int8_grouped.c"], "Q8_0 weights are dequantized per call")
    if lib is None:
        return None
    lib.int8_grouped_f32.restype = None
    lib.int8_grouped_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _I64, ctypes.c_int]
    lib.int8_grouped_vector_path.restype, lib.int8_grouped_vector_path.argtypes = ctypes.c_int, []
    lib.int8_grouped_dequantize_f32.restype = None
    lib.int8_grouped_dequantize_f32.argtypes = [_P, _P, _I64, _I64, _I64, _P, ctypes.c_int]
    return lib


def vector_path() -> bool:
    lib = library()
    return lib is not None and lib.int8_grouped_vector_path() == 1


def pack_grouped(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """q [N, K] int8 and scale [N, K / G] -> ([ceil(N / 8), K, 8] int8, [ceil(N / 8), K / G, 8] fp32): per panel
    of 8 output rows, each input column's 8 weights side by side (one widened vector); zero rows pad N."""
    n = q.shape[0]
    q = torch.nn.functional.pad(q, (0, 0, 0, -n % PANEL))
    scale = torch.nn.functional.pad(scale.float(), (0, 0, 0, -n % PANEL))
    panels = q.shape[0] // PANEL
    return (q.view(panels, PANEL, -1).transpose(1, 2).contiguous(),
            scale.view(panels, PANEL, -1).transpose(1, 2).contiguous())


def int8_grouped_native(x: Tensor, packed: Tensor, packed_scales: Tensor, group: int, bias: Tensor | None,
                        out_features: int) -> Tensor:
    """x [..., K] fp32 -> [..., out_features] fp32, with `packed`, `packed_scales` from pack_grouped (K a multiple
    of `group`) and bias [N] fp32 contiguous. Also the op `torch.ops.duet.int8_grouped_linear`, which a compiled
    graph calls without tracing into ctypes."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and packed.dtype == torch.int8
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] > KERNEL_MAX_ROWS:  # prefill: MKL's GEMM on the matrix dequantized for this call
        weight = torch.empty(out_features, k, dtype=torch.float32)
        lib.int8_grouped_dequantize_f32(packed.data_ptr(), packed_scales.data_ptr(), k, group, out_features,
                                        weight.data_ptr(), torch.get_num_threads())
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0]:
        lib.int8_grouped_f32(rows.data_ptr(), rows.shape[0], k, rows.stride(0), packed.data_ptr(),
                             packed_scales.data_ptr(), group, None if bias is None else bias.data_ptr(), y.data_ptr(),
                             out_features, torch.get_num_threads())
    return y.reshape(*x.shape[:-1], out_features)


# one opaque op (as duet::int8_linear), so a compiled decoder keeps one graph for every row count
_LIBRARY = torch.library.Library("duet", "FRAGMENT")
_LIBRARY.define("int8_grouped_linear(Tensor x, Tensor packed, Tensor packed_scales, int group, Tensor? bias, "
                "int out_features) -> Tensor")
_LIBRARY.impl("int8_grouped_linear", int8_grouped_native, "CPU")


@torch.library.register_fake("duet::int8_grouped_linear")
def _shape(x: Tensor, packed: Tensor, packed_scales: Tensor, group: int, bias: Tensor | None,
           out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
