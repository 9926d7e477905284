"""The windowed aggregates behind the dashboard stream and the rollback: windows, filters, bounds."""

import pytest

from gateway.control.stats import RequestStats, percentile
from gateway.routing.decision_log import DecisionLog


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def test_percentile_is_nearest_rank():
    assert percentile([], 99) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0


def test_window_only_counts_recent_requests_of_the_filter():
    clock = Clock()
    stats = RequestStats(max_window_s=60, clock=clock)
    stats.record(model="m", ok=True, variant="stable", ttft_s=1.0)
    clock.now += 30
    stats.record(model="m", ok=False, variant="canary", ttft_s=0.5)
    stats.record(model="other", ok=True, variant="canary", ttft_s=0.1)
    assert stats.window(10, model="m").count == 1
    w = stats.window(60, model="m")
    assert (w.count, w.errors, w.ttft_p99_s) == (2, 1, 1.0)
    canary = stats.window(60, model="m", variant="canary")
    assert canary.count == 1 and canary.error_rate == 1.0
    clock.now += 31  # the first request is now older than max_window_s: dropped
    assert stats.window(600, model="m").count == 1


def test_memory_is_bounded_at_any_rate():
    stats = RequestStats(max_samples=100, clock=Clock())
    for _ in range(1000):
        stats.record(model="m", ok=True)
    assert stats.window(10).count == 100
    with pytest.raises(ValueError):
        RequestStats(max_samples=0)


def test_snapshot_groups_by_engine_variant_and_reason():
    stats = RequestStats(clock=Clock())
    stats.record(model="m", ok=True, engine_kind="prefix", variant="stable", reason="multi_turn", output_tokens=10)
    stats.record(model="m", ok=False, engine_kind="paged", variant="canary", reason="reuse_low")
    stats.record(model="m", ok=False)  # failed before routing: no engine, no reason
    snap = stats.snapshot(window_s=10)
    assert snap["requests"] == 3 and snap["errors"] == 2 and snap["output_tokens_per_s"] == 1.0
    assert set(snap["by_engine"]) == {"prefix", "paged", "none"}
    assert snap["by_variant"]["m/canary"]["errors"] == 1
    assert snap["by_reason"] == {"multi_turn": 1, "reuse_low": 1}


def test_decision_log_rejects_zero_capacity():
    with pytest.raises(ValueError):
        DecisionLog(capacity=0)
    assert DecisionLog().recent(0) == []
