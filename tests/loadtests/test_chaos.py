"""A short `duet bench chaos` drill on real engines (tiny model, CPU): a worker killed, one frozen past
the stall timeout, Redis restarted, a gateway killed, under mixed load and hostile input. Nothing is
lost, nothing hangs, no KV page leaks, every fault recovers."""

from __future__ import annotations

import math

import pytest

from loadtests.experiments.chaos import ChaosSettings, run


@pytest.mark.timeout(300)
def test_short_chaos_drill_loses_nothing(tmp_path):
    s = ChaosSettings(clients=3, warmup_s=2.0, gap_s=1.0, stall_s=2.0, freeze_extra_s=1.5, redis_down_s=1.5,
                      first_token_s=2.0, flood_requests=24)
    result = run(s, log_dir=str(tmp_path))
    assert result["lost"] == 0 and result["hung"] == 0, result["examples"]
    assert result["leaked_pages"] == {"paged-0": 0, "prefix-1": 0}
    assert result["ok"] > 0 and result["requests"] == result["ok"] + result["clean_errors"] + \
        result["cut_by_gateway_kill"]
    assert set(result["recovery_s"]) == {"kill_worker", "freeze_worker", "restart_redis", "kill_gateway"}
    assert all(math.isfinite(v) for v in result["recovery_s"].values())
    assert result["fuzz"]["sent"] > 0 and result["fuzz"]["bad"] == 0
    assert result["rss_growth_mb"]["paged-0"]["restarted"] and result["rss_growth_mb"]["gateway-1"]["restarted"]
    assert not result["rss_growth_mb"]["gateway-0"]["restarted"]
    # the long-prompt flood (issue 21): every prompt answered or refused at once, no breaker opened by load
    flood = result["flood"]
    assert flood["lost"] == 0 and flood["ok"] > 0 and flood["ok"] + flood["refused"] == flood["sent"], flood
    assert flood["breakers_opened"] == 0, flood
