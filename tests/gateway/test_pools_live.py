"""The pool planner and routing accuracy through a live gateway and sim workers: `GET /admin/pools`,
`duet_pool_target_workers`, the cached-tokens error histogram and the stale-decision counter."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.control.pool_tracker import PoolTracker
from gateway.metrics import GatewayMetrics
from gateway.routing.route_types import RouteDecision
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir, start_sims

MODEL = model_dir().name
KEY = "pools-test-key"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    sims = start_sims([Sim("prefix"), Sim("paged")], tmp_path_factory.mktemp("sims"))
    gw = GatewayThread(gateway_config(sims, auth={"admin_key": KEY})).start()
    yield gw
    gw.stop()
    for s in sims:
        s.kill()


def sample(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels or "{" in line[: len(name) + 1] else " ")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_admin_pools_reports_target_and_current_and_the_gauge_matches(stack):
    prompt = "Summarize this document. " * 40
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        for _ in range(3):  # the same prompt again: cached on the worker the router expects
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": prompt}]})
            assert r.status_code == 200
        time.sleep(1.5)  # one planner tick
        pools = c.get("/admin/pools", headers={"Authorization": f"Bearer {KEY}"})
        assert pools.status_code == 200
        body = pools.json()
        assert body["current"] == {"paged": 1, "prefix": 1}
        assert sum(body["target"].values()) == 2 and min(body["target"].values()) >= 0
        assert body["accuracy"]["decisions"] == 3
        assert c.get("/admin/pools").status_code == 401  # the admin key is required
        metrics = c.get("/metrics").text
    for kind in ("paged", "prefix"):
        assert sample(metrics, "duet_pool_target_workers", f'kind="{kind}"') == body["target"][kind]
    assert sample(metrics, "duet_route_cached_tokens_error_count") == 3
    # nothing was evicted: no stale decision, and the ledger of queued prefill is empty again
    assert sample(metrics, "duet_route_stale_decisions_total") == 0
    assert all(v.queued_prefill_tokens == 0 for v in stack.gateway.router.views())
    # the later requests had a predicted TTFT (the rate the first one showed): each was compared with what it saw,
    # and its worker's correction is on /metrics (1.0 until a worker has served enough: calibration.py)
    assert sample(metrics, "duet_route_ttft_correction") >= 1.0


def decision(cached_blocks: int, kind: str = "prefix", steps: tuple[str, ...] = (), wanted: str = "") -> RouteDecision:
    return RouteDecision(worker_id="w", engine_kind=kind, variant="default", reason="cache_match",
                         estimated_reuse=1.0, cached_blocks=cached_blocks, steps=steps, wanted_kind=wanted)


def test_a_decision_whose_blocks_were_evicted_counts_as_stale():
    metrics = GatewayMetrics()
    t = PoolTracker(metrics)
    t.finished(0.0, decision(cached_blocks=10), 16, prompt_tokens=200, cached_tokens=160, completion_tokens=5)
    t.finished(0.0, decision(cached_blocks=10), 16, prompt_tokens=200, cached_tokens=32, completion_tokens=5)
    text = metrics.render().decode()
    assert sample(text, "duet_route_stale_decisions_total", 'engine="prefix"') == 1
    # the real figure 128 tokens under the estimate: in the (-256, -64] bucket (no _sum: the
    # histogram has negative buckets, and Prometheus then leaves the sum out)
    assert sample(text, "duet_route_cached_tokens_error_bucket", 'engine="prefix",le="-64.0"') == 1
    assert sample(text, "duet_route_cached_tokens_error_bucket", 'engine="prefix",le="-256.0"') == 0
    assert t.report(1.0)["accuracy"]["stale_share"] == 0.5


def test_work_that_spilled_is_charged_to_the_kind_routing_wanted():
    t = PoolTracker(GatewayMetrics())
    t.finished(0.0, decision(0, kind="paged", steps=("multi_turn", "spill"), wanted="prefix"), 16, 1000, 0, 10)
    rates = t.meter.rates(1.0)
    assert rates["prefix"][0] == 1000 and rates["paged"] == (0.0, 0.0)


def test_the_queued_prefill_ledger_adds_and_clears_per_request():
    t = PoolTracker(GatewayMetrics())
    t.prefill_started("r1", "w", 500)
    t.prefill_started("r2", "w", 300)
    assert t.queued("w") == 800
    t.prefill_done("r1")
    t.prefill_done("r1")  # twice is harmless
    assert t.queued("w") == 300
    t.prefill_done("r2")
    assert t.queued("w") == 0


def test_the_ledger_counts_each_tenant_s_queued_prefill_per_worker():
    t = PoolTracker(GatewayMetrics())
    t.prefill_started("r1", "w1", 500, "heavy")
    t.prefill_started("r2", "w2", 300, "heavy")
    t.prefill_started("r3", "w1", 40, "light")
    t.prefill_started("r4", "other-model", 900, "light")
    assert t.queued_by_tenant(["w1", "w2"]) == {"heavy": 800, "light": 40}
    t.prefill_done("r3")
    assert t.queued_by_tenant(["w1", "w2"]) == {"heavy": 800}  # a tenant with nothing queued is not counted
    assert t.queued("w1") == 500
