"""engine_core/kernels/cpu_int8_grouped.py (csrc/int8_grouped.c): int8 weights with one scale per group of input
columns (GGUF Q8_0's blocks of 32) give the fp32 product with the dequantized matrix, on both of the library's
paths (AVX2/FMA and portable C), at decode and prefill row counts, with N the kernel pads."""

from __future__ import annotations

import pytest
import torch

from engine_core.kernels import cpu_int8_grouped, cpu_native
from tests.support.native_build import native_builder

# (extra flags, whether the build has the vector loop, the CPU feature it needs)
PATHS = {"avx2": ("", True, "avx2"), "portable": ("-mno-avx2 -mno-fma", False, "")}


@pytest.fixture
def built(monkeypatch, tmp_path):
    """Builds the kernel into a private cache dir with the path's flags (so the build itself is tested)."""
    yield native_builder(monkeypatch, tmp_path, cpu_int8_grouped, "cpu_int8_grouped", PATHS,
                         "Q8_0 weights are dequantized per call")
    cpu_int8_grouped.library.cache_clear()


def _blocks(n: int, k: int, group: int, gen: torch.Generator):
    """int8 weights and one fp16-valued scale per `group` columns of each row, as a Q8_0 file holds them."""
    w = torch.randn(n, k, generator=gen) * 0.05
    scale = (w.view(n, k // group, group).abs().amax(2) / 127).half().float()
    q = torch.round(w / scale.repeat_interleave(group, 1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def _reference(x, q, scale, group, bias):
    weight = q.double() * scale.double().repeat_interleave(group, 1)
    y = x.double() @ weight.t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
# rows: one, a partial tile, two even tiles (decode's 16), the most the tiles take, past it (prefill: the matrix
# dequantized for MKL); groups of 32 (Q8_0) and one group a row (per channel); N a panel, N the kernel pads,
# SmolLM2's shapes
@pytest.mark.parametrize("rows,n,k,group", [(1, 8, 32, 32), (5, 33, 64, 32), (16, 96, 576, 32), (16, 40, 96, 96),
                                            (64, 45, 576, 576), (65, 45, 96, 32), (130, 576, 1536, 32),
                                            (300, 1000, 576, 576)])
def test_kernel_gives_the_product_with_the_dequantized_weights(built, path, threads, rows, n, k, group):
    built(path)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k + group)
    q, scale = _blocks(n, k, group, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    packed, packed_scales = cpu_int8_grouped.pack_grouped(q, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_int8_grouped.int8_grouped_native(x, packed, packed_scales, group, bias, n)
    finally:
        torch.set_num_threads(before)
    want = _reference(x, q, scale, group, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # fp32 sums of exact products: off by summation rounding only (a wrong column, group or scale is O(1))
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_kernel_takes_strided_rows_leading_dims_and_no_bias(built):
    built("avx2" if "avx2" in cpu_native._cpu_flags().split() else "portable")
    gen = torch.Generator().manual_seed(7)
    q, scale = _blocks(24, 64, 32, gen)
    x = torch.randn(2, 3, 100, generator=gen)[..., :64]  # rows 100 floats apart
    got = cpu_int8_grouped.int8_grouped_native(x, *cpu_int8_grouped.pack_grouped(q, scale), 32, None, 24)
    want = _reference(x.reshape(-1, 64), q, scale, 32, None).reshape(2, 3, 24)
    assert got.shape == (2, 3, 24)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
