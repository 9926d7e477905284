"""bf16 matmul on CPU with bf16 dot products or AMX tiles (csrc/bf16_linear.c), for a bf16 model's layers.

    vector_path() -> bool                       # the library is built with its AVX512_BF16 loop
    serves_here() -> bool                       # a bf16 model's layers take it for every call (not where AMX is)
    amx_path() -> bool                          # it runs on AMX tiles (inputs a multiple of 32 wide)
    serves_width(in_features) -> bool           # a layer of this width gets panels at all (above, or AMX)
    pack_bf16(w [N, K] bf16) -> Tensor          # the kernel's panel layout, once at load
    bf16_linear_native(x, packed, bias, out_features) -> y   # y = x w^T + bias, bf16, fp32 sums

What it wins: on a CPU with AVX512_BF16 and no AMX, oneDNN's bf16 inner product runs decode-sized calls far below
the machine's memory speed and its dot-product rate (csrc/bf16_linear.c says by how much); this kernel reads each
weight vector once per 8 rows, as it lies, into 8 x 48 sums held in registers. cpu_linear.BF16PackedLinear takes
it for every call where `serves_here()`: the vector loop built, and no AMX. On AMX the kernel runs on the tiles,
1.1-1.6x oneDNN's speed up to 64 rows and behind it from about 128 (loadtests/profiles/matmul_bench.py, on an
AMX Xeon, docs/benchmarks.md): there the layers take it for decode-sized calls and oneDNN for the rest, and the
LM head for every call (its fp32 logits). Elsewhere the library's portable loop computes the same sums (the tests
hold both to one reference) but slower than oneDNN, which stays. DUET_NATIVE_CPU_BF16=0 keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from engine_core.kernels.cpu_native import _CSRC, _cpu_flags, build_and_load

PANEL = 16  # output columns per panel (one 512-bit vector of fp32 sums); must match csrc/bf16_linear.c
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("DUET_NATIVE_CPU_BF16", "1") == "0":
        return None
    lib = build_and_load("cpu_bf16_linear", [_CSRC / "bf16_linear.c"], "bf16 matmuls use oneDNN")
    if lib is None:
        return None
    lib.bf16_linear.restype = ctypes.c_int
    lib.bf16_linear.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int, _I64, ctypes.c_int]
    lib.bf16_linear_vector_path.restype, lib.bf16_linear_vector_path.argtypes = ctypes.c_int, []
    lib.bf16_linear_amx.restype, lib.bf16_linear_amx.argtypes = ctypes.c_int, []
    return lib


def vector_path() -> bool:
    lib = library()
    return lib is not None and lib.bf16_linear_vector_path() == 1


def serves_here() -> bool:
    return vector_path() and "amx_bf16" not in _cpu_flags().split()


def amx_path() -> bool:
    """The library runs on AMX tiles (built for a CPU with AMX, lent by the OS), for inputs a multiple of 32 wide."""
    lib = library()
    return lib is not None and lib.bf16_linear_amx() == 1


def serves_width(in_features: int) -> bool:
    """A layer this wide gets the kernel's panels: wherever the kernel serves every call, and on AMX, whose tile
    path needs a width that is a multiple of 32 (cpu_linear.BF16PackedLinear: which calls take them)."""
    return serves_here() or (amx_path() and in_features % 32 == 0)


def pack_bf16(w: Tensor) -> Tensor:
    """w [N, K] bf16 -> [ceil(N / 16), ceil(K / 2), 16, 2]: per panel of 16 output rows, each pair of input
    columns of those rows side by side (one vector's worth); zeros pad N and K."""
    n, k = w.shape
    w = torch.nn.functional.pad(w.detach(), (0, k % 2, 0, -n % PANEL))
    return w.view(w.shape[0] // PANEL, PANEL, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_linear_native(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int,
                       fp32_out: bool = False) -> Tensor:
    """x [..., K] bf16 -> [..., out_features] bf16 (fp32 with `fp32_out`: the fp32 sums as they are); `packed`
    from pack_bf16, bias [N] bf16 contiguous. The same result as x @ w^T + bias summed in fp32 and rounded to bf16
    once. Also the op `torch.ops.duet.bf16_linear`, which a compiled graph calls without tracing into ctypes."""
    lib = library()
    assert lib is not None and x.dtype == torch.bfloat16 and packed.dtype == torch.bfloat16
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.float32 if fp32_out else torch.bfloat16)
    if rows.shape[0]:
        rc = lib.bf16_linear(rows.data_ptr(), rows.shape[0], k, rows.stride(0), packed.data_ptr(),
                             None if bias is None else bias.data_ptr(), y.data_ptr(), int(fp32_out), out_features,
                             torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"bf16 matmul: no memory for {rows.shape[0]} x {k} rows")
    return y.reshape(*x.shape[:-1], out_features)


# registered with torch.library's low-level API (as cpu_linear's duet::cpu_linear, for the same per-call cost), so
# a compiled decoder (engine_core/cpu_compile.py) keeps one graph for every row count around an opaque call
_LIBRARY = torch.library.Library("duet", "FRAGMENT")
_LIBRARY.define("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, bool fp32_out=False) -> Tensor")
_LIBRARY.impl("bf16_linear", bf16_linear_native, "CPU")


@torch.library.register_fake("duet::bf16_linear")
def _bf16_linear_shape(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int,
                       fp32_out: bool = False) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32 if fp32_out else torch.bfloat16)
