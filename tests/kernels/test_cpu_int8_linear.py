"""engine_core/kernels/cpu_int8_linear.py (csrc/int8_linear.c): the int8 weight-only matmul with bf16 dot products
gives the exact product of the bf16-rounded rows with the int8 weights, scaled, on both of its paths (AVX512_BF16
and portable C), at decode and prefill row counts, with shapes the kernel pads (odd K, N not a multiple of 16)."""

from __future__ import annotations

import pytest
import torch

from engine_core.kernels import cpu_int8_linear, cpu_native
from tests.support.native_build import native_builder

# (extra flags, whether the build has the vector loop, the CPU feature it needs)
PATHS = {"avx512_bf16": ("", True, "avx512_bf16"), "portable": ("-mno-avx512bf16", False, "")}


@pytest.fixture
def built(monkeypatch, tmp_path):
    """Builds the kernel into a private cache dir with the path's flags (so the build itself is tested)."""
    yield native_builder(monkeypatch, tmp_path, cpu_int8_linear, "cpu_int8_linear", PATHS,
                         "torch's int8 kernel serves")
    cpu_int8_linear.library.cache_clear()


def _quantized(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * 0.05
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
# rows: one, a partial tile, exactly one tile, past one tile (the widened panel), many tiles;
# (n, k): a panel, N and K the kernel pads, SmolLM2's shapes
@pytest.mark.parametrize("rows,n,k", [(1, 16, 64), (5, 33, 65), (16, 96, 576), (17, 40, 31), (70, 576, 1536),
                                      (300, 960, 576)])
def test_kernel_gives_the_exact_product_of_bf16_rows_and_int8_weights(built, path, threads, rows, n, k):
    built(path)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scale = _quantized(n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    want = (x.bfloat16().double() @ q.double().t()) * scale.double() + bias.double()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_int8_linear.int8_linear_native(x, cpu_int8_linear.pack_int8(q), scale, bias, n)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # fp32 sums of exact bf16 x int8 products: off by summation rounding only (a wrong pair or column is O(1))
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_kernel_takes_strided_rows_leading_dims_and_no_bias(built):
    built("portable" if "avx512_bf16" not in cpu_native._cpu_flags().split() else "avx512_bf16")
    gen = torch.Generator().manual_seed(7)
    q, scale = _quantized(48, 64, gen)
    wide = torch.randn(2, 3, 100, generator=gen)
    x = wide[..., :64]  # rows 100 floats apart
    got = cpu_int8_linear.int8_linear_native(x, cpu_int8_linear.pack_int8(q), scale, None, 48)
    want = (x.bfloat16().double() @ q.double().t()) * scale.double()
    assert got.shape == (2, 3, 48)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    empty = cpu_int8_linear.int8_linear_native(torch.empty(0, 64), cpu_int8_linear.pack_int8(q), scale, None, 48)
    assert empty.shape == (0, 48)


def test_the_switch_keeps_torchs_kernel(built, monkeypatch):
    monkeypatch.setenv("DUET_NATIVE_CPU_INT8", "0")
    cpu_int8_linear.library.cache_clear()
    assert cpu_int8_linear.library() is None and not cpu_int8_linear.vector_path()
