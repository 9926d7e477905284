"""loadtests/experiments/profile_cost.py: the A/B of gateways with the workload profile and the capture off and on,
small (real `duet gateway` processes over real sim workers, 20 streams a burst instead of 1,000)."""

from __future__ import annotations

import asyncio

from loadtests.experiments.profile_cost import run, summarize


def test_every_round_measures_fresh_gateways_and_pairs_each_variant_with_off():
    out = asyncio.run(run(rounds=2, variants=("off", "on", "off2"), streams=20))
    assert out["fresh_gateways_per_round"] is True
    assert len(out["rounds"]) == 2
    pids = [row[f"{name}_pid"] for row in out["rounds"] for name in ("off", "on", "off2")]
    assert len(set(pids)) == 6, pids  # a new process per variant per round: no process is measured twice
    for row in out["rounds"]:
        assert sorted(row["order"]) == ["off", "off2", "on"]
        for name in ("off", "on", "off2"):
            assert row[f"{name}_errors"] == 0, row
            assert row[f"{name}_cpu_ms_per_request"] > 0
        assert row["on_ratio_to_off"] == round(row["on_cpu_ms_per_request"] / row["off_cpu_ms_per_request"], 4)
    # the JSON the earlier runs wrote is still there, beside the new fields
    for key in ("off_cpu_ms_per_request", "on_cpu_ms_per_request", "on_overhead_share", "overhead_share",
                "on_round_ratio_median", "off2_round_ratio_median"):
        assert key in out, key
    assert set(out["ab_vs_aa"]) == {"on", "off2"}


def test_the_same_processes_mode_keeps_one_gateway_per_variant():
    out = asyncio.run(run(rounds=2, variants=("off", "on"), streams=10, fresh=False))
    assert out["fresh_gateways_per_round"] is False
    first, second = out["rounds"]
    assert first["off_pid"] == second["off_pid"] and first["on_pid"] == second["on_pid"]
    assert first["order"] == ["off", "on"] and second["order"] == ["on", "off"]  # rotated


def test_the_ab_is_reported_beside_the_aa_spread_of_the_same_rounds():
    rows = [{"off_cpu_ms_per_request": off, "on_cpu_ms_per_request": on, "off2_cpu_ms_per_request": off2,
             "on_ratio_to_off": round(on / off, 4), "off2_ratio_to_off": round(off2 / off, 4)}
            for off, on, off2 in ((2.0, 2.1, 2.0), (2.0, 2.04, 2.02), (2.0, 2.06, 1.98), (2.0, 2.02, 2.04))]
    out = summarize(rows, ("off", "on", "off2"))
    assert out["on_round_ratio_median"] == 1.025
    assert out["on_round_ratio_range"] == [1.01, 1.05]
    assert out["on_rounds_above_1"] == 4 and out["off2_rounds_above_1"] == 2
    assert out["ab_vs_aa"]["on"]["overhead_median"] == 0.025
    assert out["ab_vs_aa"]["off2"]["overhead_median"] == 0.005
    assert out["ab_vs_aa"]["off2"]["range"] == 0.03  # 0.99 .. 1.02
    assert out["on_cpu_ms_per_request"] == 2.05 and out["on_overhead_share"] == 0.025


def test_gc_off_runs_python_own_gc_and_each_row_has_memory_and_collections():
    out = asyncio.run(run(rounds=1, variants=("off", "gc_off"), streams=100))
    (row,) = out["rounds"]
    for name in ("off", "gc_off"):
        assert row[f"{name}_errors"] == 0 and row[f"{name}_rss_mb"] > 20, row
        assert len(row[f"{name}_gc_collections"]) == 3, row
    # startup (imports: ~200 generation-0 collections before the policy applies) is alike; the warm-up and the
    # burst, 150 streams, make ~70 more with Python's GC and a handful with the gateway's policy
    assert row["gc_off_gc_collections"][0] > row["off_gc_collections"][0] + 20, row


def test_dropped_streams_are_counted_and_the_burst_waits_for_the_gateway_to_settle():
    out = asyncio.run(run(rounds=1, variants=("off",), streams=20, fresh=False, drop_after_s=0.05))
    (row,) = out["rounds"]
    assert out["drop_after_s"] == 0.05
    assert row["off_errors"] == 20, row  # 16 tokens at 20 ms take longer than 50 ms: every stream dropped
    assert row["off_cpu_ms_per_request"] > 0 and row["off_rss_mb"] > 20, row
