"""`decode_attention_bench --against`: another checkout's kernel, called as this one's, alternating with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.kernels.cpu_native import native_available
from engine_core.kernels.cpu_paged_decode import paged_decode_native
from loadtests.profiles import decode_attention_bench as bench

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler: no native kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_other_checkouts_kernel_computes_what_this_ones_does(dtype):
    caches, tables, lens, q = bench._caches(3, 45, 16, True, dtype)
    k, v = caches[0]
    other = bench.other_kernel(REPO)  # the same sources: the same kernel, built apart
    assert torch.equal(other(q, k, v, tables, lens, 0.125, 45), paged_decode_native(q, k, v, tables, lens, 0.125, 45))


def test_against_prints_both_sides_and_their_ratio_per_layout(capsys):
    assert bench.main(["--rows", "2", "--context", "40", "--page-sizes", "16", "--repeats", "3", "--dtype",
                       "bfloat16", "--against", str(REPO)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("page")]
    assert [line.split(":")[0] for line in lines] == ["page  16 contiguous", "page  16 scattered"]
    assert all("this / that" in line and str(REPO) in line for line in lines)
