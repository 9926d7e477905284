"""loadtests/sim/calibrate/h200.py on a machine without CUDA: it says so and measures nothing; its step shapes
fit the 64 GiB of KV it promises; a long prefill is compute-bound and a decode batch memory-bound in the roofline."""

from __future__ import annotations

import pytest
import torch

from loadtests.sim.calibrate import h200 as calibrate_h200
from loadtests.sim.fleet.cost_models import RooflineCostModel, shape_of


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_cuda_it_exits_2_and_says_why(capsys):
    assert calibrate_h200.main(["--json"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_every_step_shape_fits_the_kv_it_promises():
    kv_bytes = RooflineCostModel().kv_bytes_per_token
    for step in calibrate_h200.step_shapes():
        tokens = sum(n + start for n, start in step)
        assert tokens * kv_bytes <= 64 * 1024**3 + 32 * 1024**2  # 64 GiB, plus the rounding of a step's pages
        assert max(n + start for n, start in step) <= calibrate_h200.MAX_POSITIONS


def test_runs_collapse_a_decode_batch_into_one_entry():
    assert calibrate_h200._runs([(512, 0)] + [(1, 2048)] * 32) == [(1, 512, 0), (32, 1, 2048)]


def test_a_long_prefill_is_compute_bound_and_a_decode_batch_memory_bound():
    m = RooflineCostModel()

    def compute_s(s):
        return m.flops(s) / (m.peak_flops * m.compute_efficiency)

    def memory_s(s):
        return m.bytes_moved(s) / (m.peak_bytes_per_s * m.bandwidth_efficiency)

    prefill = shape_of(calibrate_h200._chunks([(8192, 0)], calibrate_h200.PAGE_SIZE, 1000))
    decode = shape_of(calibrate_h200._chunks([(1, 2048)] * 32, calibrate_h200.PAGE_SIZE, 1000))
    assert compute_s(prefill) > 5 * memory_s(prefill)
    assert memory_s(decode) > 5 * compute_s(decode)
    assert m.step_seconds(prefill) == pytest.approx(compute_s(prefill) + m.step_overhead_s)
