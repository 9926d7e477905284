"""`duet bench compare` at tiny scale: four real stacks (engine workers + gateway; one with the pool
planner) on the tiny checkpoint, the same small mixed workload, the JSON the headline figures come from."""

from __future__ import annotations

import subprocess
import sys

import pytest

from duet.model_make import default_model_dir
from loadtests.experiments.compare import CONFIGS, SHARES, CompareError, Settings, run
from loadtests.load.workloads import parse_shares

CLASSES = {"multi_turn", "agent", "long_doc"}


@pytest.fixture(scope="module")
def result() -> dict:
    s = Settings(model=str(default_model_dir()), workers=2, num_requests=12, rates=("20",), repeats=1,
                 max_prompt_tokens=256, max_tokens=6, ttft_slo_ms=60_000, itl_slo_ms=60_000, ready_timeout_s=120)
    return run(s)


def runs(result: dict) -> dict:
    return {name: rs[0] for name, rs in result["rates"]["20"]["runs"].items()}


@pytest.mark.timeout(300)
def test_every_configuration_reports_goodput_and_ttft_per_class(result):
    assert set(runs(result)) == set(CONFIGS)
    for name, r in runs(result).items():
        assert r["num_requests"] == 12 and r["num_errors"] == 0, (name, r["errors"])
        assert 0 < r["goodput_rps"] <= r["request_throughput_rps"]
        assert set(r["classes"]) == CLASSES
        for cls in r["classes"].values():
            assert 0 < cls["ttft_p50_ms"] <= cls["ttft_p99_ms"]
            assert cls["goodput_rps"] <= r["goodput_rps"]
        assert sum(w["requests"] for w in r["worker_load"].values()) == 12
    # SLOs this loose: every request is good, so goodput is the request rate
    assert all(r["num_good"] == 12 for r in runs(result).values())
    summary = result["rates"]["20"]["summary"]
    rs = runs(result)
    best_homogeneous = max(rs["all_paged"]["goodput_rps"], rs["all_prefix"]["goodput_rps"])
    paged_doc_p99 = rs["all_paged"]["classes"]["long_doc"]["ttft_p99_ms"]
    for name in CONFIGS:  # one repeat: each median is that run's ratio to the baselines' run
        ratio = summary[name]["goodput_ratio_vs_best_homogeneous"]
        assert ratio["n"] == 1 and ratio["median"] == pytest.approx(rs[name]["goodput_rps"] / best_homogeneous)
        doc = summary[name]["long_doc_ttft_p99_ratio_vs_paged"]
        assert doc["n"] == 1
        assert doc["median"] == pytest.approx(rs[name]["classes"]["long_doc"]["ttft_p99_ms"] / paged_doc_p99)
    # the headline is the planner stack's
    assert result["goodput_ratio_vs_best_homogeneous"]["20"] == summary["duet_planner"][
        "goodput_ratio_vs_best_homogeneous"]["median"]
    assert result["long_doc_ttft_p99_ratio_vs_paged"]["20"] == summary["duet_planner"][
        "long_doc_ttft_p99_ratio_vs_paged"]["median"]
    assert result["kv_cache_tokens_per_worker"] == Settings().limits.kv_cache_tokens == 4096


@pytest.mark.timeout(300)
def test_baselines_route_only_to_their_engine_kind(result):
    # from the x-duet-engine headers the client captured
    r = runs(result)
    assert r["all_paged"]["engines"] == {"paged": 12}
    assert r["all_prefix"]["engines"] == {"prefix": 12}
    assert {w["engine"] for w in r["duet_fixed"]["worker_load"].values()} == {"paged", "prefix"}
    # the planner stack ran its pool manager (two workers: one of each kind while both have traffic)
    assert r["duet_planner"]["workers_after"] == {"paged": 1, "prefix": 1}


def test_bad_settings_are_refused_with_the_setting_named():
    with pytest.raises(CompareError, match="--workers must be at least 2"):
        Settings(workers=1).validate()
    with pytest.raises(CompareError, match="--configs"):
        Settings(configs=("fastest",)).validate()
    with pytest.raises(CompareError, match="--mix"):
        Settings(shares=(("sessions", 1.0),)).validate()
    with pytest.raises(ValueError, match="--mix: unknown class 'sessions'"):  # the one --mix parser says so first
        parse_shares("sessions=1", tuple(SHARES))
    with pytest.raises(CompareError, match="--rates"):
        Settings(rates=("brisk",)).validate()
    assert parse_shares("multi_turn=2,agent=0,long_doc=1", tuple(SHARES)) == {"multi_turn": 2.0, "agent": 0.0, "long_doc": 1.0}
    out = subprocess.run([sys.executable, "-m", "loadtests.cli", "compare", "--workers", "1"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "duet bench compare: error: --workers must be at least 2" in out.stderr


def test_a_run_brings_rate_times_run_seconds_arrivals():
    # an arrival is a conversation's first turn or a document; later turns follow their parents
    from loadtests.experiments.compare import workload

    s = Settings(max_prompt_tokens=256, max_tokens=6)
    for rate in (0.15, 0.30):
        requests = workload(default_model_dir(), s, rate)
        arrivals = sum(1 for r in requests if r.depends_on is None)
        assert arrivals == round(rate * s.run_seconds)
