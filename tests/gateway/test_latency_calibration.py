"""Routing's learned latency correction per worker (gateway/routing/calibration.py): observed over predicted, a ratio of
sums over the worker's recent requests, applied once it has enough of them."""

from __future__ import annotations

import pytest

from gateway.routing.calibration import MIN_SAMPLES, LatencyCalibration
from gateway.routing.prefix_index import WorkerBlockIndex
from gateway.routing.route_types import RouteDecision, WorkerView
from gateway.serving.router import Router


def test_the_correction_is_observed_over_predicted_once_enough_requests_were_seen():
    cal = LatencyCalibration(window=4, min_samples=2)
    assert cal.observe("w", 1.0, 3.0, 0.1, 0.1) == (1.0, 1.0)  # one request: not enough to learn from
    assert cal.observe("w", 3.0, 3.0, 0.1, 0.2) == (pytest.approx(1.5), pytest.approx(1.5))  # 6/4, 0.3/0.2
    assert cal.correction("other") == (1.0, 1.0)
    # a ratio of sums: the long wait weighs more than the short one
    cal.observe("w", 10.0, 10.0)
    assert cal.correction("w").ttft == pytest.approx(16 / 14)


def test_the_window_forgets_old_requests_and_a_missing_figure_is_not_a_sample():
    cal = LatencyCalibration(window=3, min_samples=1)
    for _ in range(3):
        cal.observe("w", 1.0, 4.0)
    for _ in range(3):
        cal.observe("w", 1.0, 1.0, None, 0.5)  # no TPOT predicted: nothing to learn of the TPOT
    assert cal.correction("w") == (1.0, 1.0)
    cal.observe("w", 0.0, 1.0)  # a zero prediction has no ratio
    assert cal.correction("w").ttft == 1.0
    cal.forget("w")
    assert cal.correction("w") == (1.0, 1.0)
    with pytest.raises(ValueError, match="min_samples"):
        LatencyCalibration(window=4, min_samples=5)


def test_the_router_learns_from_what_its_decisions_predicted_and_reports_each_correction():
    views = [WorkerView(worker_id="w0", model_id="m", engine_kind="prefix", version="v1", capabilities=frozenset(),
                        healthy=True, draining=False, num_running=0, num_waiting=0, kv_usage=0.0)]
    seen = []
    router = Router(lambda: views, WorkerBlockIndex(), on_observe=lambda wid, c: seen.append((wid, c)))
    decision = RouteDecision("w0", "prefix", "default", "least_load", 0.0, 0, modelled_ttft_s=0.2,
                             modelled_tpot_s=0.05)
    for _ in range(MIN_SAMPLES):
        router.observe(decision, 0.6, 0.05)
    assert seen[-1] == ("w0", (pytest.approx(3.0), pytest.approx(1.0)))
    assert router.views()[0].ttft_correction == pytest.approx(3.0)
    # a decision without a prediction (no measured rate, or a baseline policy) teaches nothing
    router.observe(RouteDecision("w0", "prefix", "default", "least_load", 0.0, 0), 9.0, 9.0)
    assert len(seen) == MIN_SAMPLES
