"""`duet bench compare` at tiny scale: three real stacks (engine workers + gateway) on the tiny
checkpoint, the same small mixed workload, the JSON the headline figures come from."""

from __future__ import annotations

import subprocess
import sys

import pytest

from duet.model_make import default_model_dir
from loadtests.compare import CONFIGS, CompareError, Settings, run

CLASSES = {"multi_turn", "agent", "long_doc"}


@pytest.fixture(scope="module")
def result() -> dict:
    s = Settings(model=str(default_model_dir()), workers=2, num_requests=12, rate=20.0, max_prompt_tokens=256,
                 max_tokens=6, ttft_slo_ms=60_000, itl_slo_ms=60_000, ready_timeout_s=120)
    return run(s)


@pytest.mark.timeout(240)
def test_every_configuration_reports_goodput_and_ttft_per_class(result):
    assert set(result["configs"]) == set(CONFIGS)
    for name, r in result["configs"].items():
        assert r["num_requests"] == 12 and r["num_errors"] == 0, (name, r["errors"])
        assert 0 < r["goodput_rps"] <= r["request_throughput_rps"]
        assert set(r["classes"]) == CLASSES
        for cls in r["classes"].values():
            assert 0 < cls["ttft_p50_ms"] <= cls["ttft_p99_ms"]
            assert cls["goodput_rps"] <= r["goodput_rps"]
        assert sum(w["requests"] for w in r["worker_load"].values()) == 12
    # SLOs this loose: every request is good, so goodput is the request rate
    assert all(r["num_good"] == 12 for r in result["configs"].values())
    assert result["goodput_ratio_vs_best_homogeneous"] > 0
    assert result["long_doc_ttft_p99_ratio_vs_paged"] > 0


@pytest.mark.timeout(240)
def test_baselines_route_only_to_their_engine_kind(result):
    # from the x-duet-engine / x-duet-route-reason headers the client captured
    paged, prefix, duet = (result["configs"][c] for c in ("paged_round_robin", "prefix_cache_aware", "duet"))
    assert paged["engines"] == {"paged": 12}
    assert {reason for per in paged["route_reasons"].values() for reason in per} == {"round_robin"}
    assert sorted(w["requests"] for w in paged["worker_load"].values()) == [6, 6]  # in turn
    assert prefix["engines"] == {"prefix": 12}
    assert {w["engine"] for w in duet["worker_load"].values()} == {"paged", "prefix"}


def test_bad_settings_are_refused_with_the_setting_named():
    with pytest.raises(CompareError, match="--workers must be at least 2"):
        Settings(workers=1).validate()
    with pytest.raises(CompareError, match="--configs"):
        Settings(configs=("fastest",)).validate()
    out = subprocess.run([sys.executable, "-m", "loadtests.cli", "compare", "--workers", "1"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "duet bench compare: error: --workers must be at least 2" in out.stderr
