"""engine_core/kernels/cpu_bf16_linear.py (csrc/bf16_linear.c): the bf16 matmul with bf16 dot products gives the
exact product of the bf16 rows and weights, rounded to bf16 once, on each of its paths (AMX tiles, AVX512_BF16 and
portable C), at decode and prefill row counts, with shapes the kernel pads (odd K, N not a multiple of its panels)."""

from __future__ import annotations

import pytest
import torch

from engine_core.kernels import cpu_bf16_linear, cpu_native
from tests.support.native_build import native_builder

# (extra flags, whether the build has the vector loop, the CPU feature it needs); the AMX build takes the tiles for
# widths that are a multiple of 32 and the vector loop for the others
_NO_AMX = "-mno-amx-tile -mno-amx-bf16"
PATHS = {"amx": ("", True, "amx_bf16"), "avx512_bf16": (_NO_AMX, True, "avx512_bf16"),
         "portable": (f"{_NO_AMX} -mno-avx512bf16", False, "")}


@pytest.fixture
def built(monkeypatch, tmp_path):
    """Builds the kernel into a private cache dir with the path's flags (so the build itself is tested)."""
    yield native_builder(monkeypatch, tmp_path, cpu_bf16_linear, "cpu_bf16_linear", PATHS, "oneDNN serves")
    cpu_bf16_linear.library.cache_clear()


def _close_to_the_exact_product(got: torch.Tensor, want: torch.Tensor) -> bool:
    """One rounding of an fp32 sum to bf16: each output within 2^-8 of its exact value (relative), plus the fp32
    summation's rounding; a wrong pair, column or row is off by O(1) of the outputs' scale."""
    err = (got.double() - want).abs()
    return bool((err <= want.abs() * 2.0**-8 + 1e-5 * want.abs().max()).all())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
# rows: one, a partial row tile, exactly one tile, past one tile, many tiles (AMX: blocks of 32 and the rows
# left); (n, k): one panel, N and K the kernel pads (a last group of 1 or 2 panels), SmolLM2's shapes
@pytest.mark.parametrize("rows,n,k", [(1, 16, 64), (3, 33, 65), (8, 96, 576), (17, 40, 31), (70, 576, 1536),
                                      (300, 960, 576), (16, 80, 64), (45, 48, 96)])
def test_kernel_gives_the_exact_product_of_bf16_rows_and_weights_rounded_once(built, path, threads, rows, n, k):
    built(path)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want = x.double() @ w.double().t() + bias.double()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_bf16_linear.bf16_linear_native(x, cpu_bf16_linear.pack_bf16(w), bias, n)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert _close_to_the_exact_product(got, want)
    assert cpu_bf16_linear.amx_path() == (path == "amx")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows,n", [(3, 50), (40, 64)])  # AMX: a partial row tile; a block of 32 rows and 8 more
def test_fp32_out_gives_the_fp32_sums_unrounded(built, path, rows, n):
    """The LM head's call: logits keep their fp32 sums (bf16 logits near 25 are 0.125 apart: greedy ties)."""
    built(path)
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(n, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    want = x.double() @ w.double().t()
    got = cpu_bf16_linear.bf16_linear_native(x, cpu_bf16_linear.pack_bf16(w), None, n, fp32_out=True)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # fp32 summation rounding only: far inside one bf16 step (2^-8 relative), which a rounded output would show
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_kernel_takes_strided_rows_leading_dims_and_no_bias(built):
    flags = cpu_native._cpu_flags().split()
    built("amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "portable")
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=gen).bfloat16()
    wide = torch.randn(2, 3, 100, generator=gen).bfloat16()
    x = wide[..., :64]  # rows 100 elements apart
    got = cpu_bf16_linear.bf16_linear_native(x, cpu_bf16_linear.pack_bf16(w), None, 48)
    assert got.shape == (2, 3, 48)
    assert _close_to_the_exact_product(got, x.double() @ w.double().t())
    odd = torch.randn(5, 200, generator=gen).bfloat16()[:, :63]  # odd K and strided: the copied rows
    w63 = torch.randn(20, 63, generator=gen).bfloat16()
    got = cpu_bf16_linear.bf16_linear_native(odd, cpu_bf16_linear.pack_bf16(w63), None, 20)
    assert _close_to_the_exact_product(got, odd.double() @ w63.double().t())
    empty = cpu_bf16_linear.bf16_linear_native(torch.empty(0, 64).bfloat16(), cpu_bf16_linear.pack_bf16(w), None, 48)
    assert empty.shape == (0, 48)


def test_the_switch_keeps_onednn(built, monkeypatch):
    monkeypatch.setenv("DUET_NATIVE_CPU_BF16", "0")
    cpu_bf16_linear.library.cache_clear()
    assert cpu_bf16_linear.library() is None and not cpu_bf16_linear.vector_path()
