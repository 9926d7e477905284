"""The admin API: key checks, routing validation with reasons, audit, decisions, drain, the SSE stream.

These run the real admin routes over the real in-memory state store, stats, decision log and rollback
controller, behind a small backend standing in for the worker pool (the live-stack tests use the real one)."""

import json

import httpx
import pytest
from starlette.applications import Starlette

from gateway.control.admin import admin_routes, key_id, stream_event
from gateway.control.rollback import RollbackController
from gateway.control.shadow import ShadowLedger
from gateway.control.shadow_sync import ShadowSync
from gateway.control.state.memory import MemoryStore
from gateway.control.stats import RequestStats
from gateway.routing.decision_log import DecisionLog
from gateway.routing.route_types import RouteDecision

KEY = "adm-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Backend:
    def __init__(self, admin_key=KEY):
        self.state = MemoryStore()
        self.stats = RequestStats()
        self.decisions = DecisionLog(capacity=50)
        self.rollback = RollbackController(store=self.state, stats=self.stats)
        self.shadow = ShadowLedger()
        self.shadow_sync = ShadowSync(self.shadow, self.state)
        self.admin_key = admin_key
        self.workers = [
            {"worker_id": "p1", "model_id": "m", "engine_kind": "paged", "version": "v1", "healthy": True,
             "draining": False, "num_running": 1, "num_waiting": 0, "kv_usage": 0.25, "prefix_hit_rate": 0.0},
            {"worker_id": "x1", "model_id": "m", "engine_kind": "prefix", "version": "v2", "healthy": True,
             "draining": False, "num_running": 0, "num_waiting": 2, "kv_usage": 0.5, "prefix_hit_rate": 0.6},
        ]

    def model_ids(self):
        return ["m"]

    def worker_rows(self):
        return [dict(w) for w in self.workers]

    async def drain_worker(self, worker_id):
        for w in self.workers:
            if w["worker_id"] == worker_id:
                w["draining"] = True
                return True
        return False


GOOD = {
    "sticky_key": "user", "reuse_threshold": 0.4,
    "variants": [
        {"name": "stable", "weight": 90, "pools": [{"engine_kind": "paged", "version": "v1"}]},
        {"name": "canary", "weight": 10, "pools": [{"engine_kind": "prefix", "version": "v2"}]},
    ],
}


@pytest.fixture
def backend():
    return Backend()


@pytest.fixture
async def client(backend):
    app = Starlette(routes=admin_routes(backend))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


async def test_admin_key_is_required(client, backend):
    r = await client.get("/admin/workers")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = await client.get("/admin/workers", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    backend.admin_key = None
    r = await client.get("/admin/workers", headers=AUTH)
    assert r.status_code == 403 and "DUET_ADMIN_KEY" in r.json()["error"]["message"]


async def test_put_routing_applies_and_audits_with_key_id(client, backend):
    r = await client.put("/admin/models/m/routing", json=GOOD, headers=AUTH)
    assert r.status_code == 200, r.text
    cfg = await backend.state.get_routing("m")
    assert [(v.name, v.weight) for v in cfg.variants] == [("stable", 90.0), ("canary", 10.0)]
    assert (await client.get("/admin/models/m/routing", headers=AUTH)).json()["reuse_threshold"] == 0.4

    changed = json.loads(json.dumps(GOOD))
    changed["variants"][1]["weight"] = 30
    assert (await client.put("/admin/models/m/routing", json=changed, headers=AUTH)).status_code == 200
    entries = (await client.get("/admin/audit?limit=10", headers=AUTH)).json()["entries"]
    assert len(entries) == 2
    newest = entries[0]
    assert newest["actor"] == key_id(KEY) and KEY not in json.dumps(entries)
    assert newest["model"] == "m" and newest["time"] > 0
    assert newest["before"]["variants"][1]["weight"] == 10 and newest["after"]["variants"][1]["weight"] == 30


@pytest.mark.parametrize("mutate, reason", [
    (lambda c: c["variants"][0].update(weight=-1), "weight >= 0"),
    (lambda c: [v.update(weight=0) for v in c["variants"]], "positive"),
    (lambda c: c["variants"][1]["pools"][0].update(version="v9"), "no worker of model 'm' is in pool prefix@v9"),
    (lambda c: c["variants"][1]["pools"][0].update(engine_kind="turbo"), "unknown engine kind"),
    (lambda c: c.update(reuse_threshold=1.5), "reuse_threshold must be in [0, 1]"),
    (lambda c: c.update(sticky_key="ip"), "sticky_key"),
    (lambda c: c.update(surprise=1), "unknown routing config keys"),
])
async def test_put_routing_rejects_bad_config_with_reason(client, backend, mutate, reason):
    bad = json.loads(json.dumps(GOOD))
    mutate(bad)
    r = await client.put("/admin/models/m/routing", json=bad, headers=AUTH)
    assert r.status_code == 400
    assert reason in r.json()["error"]["message"]
    assert await backend.state.get_routing("m") is None and await backend.state.audit_log() == []


async def test_unknown_model_and_bad_json_are_400(client):
    r = await client.put("/admin/models/nope/routing", json=GOOD, headers=AUTH)
    assert r.status_code == 400 and "unknown model" in r.json()["error"]["message"]
    r = await client.put("/admin/models/m/routing", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = await client.get("/admin/decisions?limit=0", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_workers_and_drain(client, backend):
    r = await client.get("/admin/workers", headers=AUTH)
    assert {w["worker_id"] for w in r.json()["workers"]} == {"p1", "x1"}
    r = await client.post("/admin/workers/x1/drain", headers=AUTH)
    assert r.status_code == 200 and r.json()["draining"]
    rows = {w["worker_id"]: w for w in (await client.get("/admin/workers", headers=AUTH)).json()["workers"]}
    assert rows["x1"]["draining"] and not rows["p1"]["draining"]
    assert (await client.post("/admin/workers/ghost/drain", headers=AUTH)).status_code == 404


async def test_decisions_are_the_last_n_newest_first(client, backend):
    for i in range(60):
        backend.decisions.record(
            request_id=f"r{i}", model="m", num_prompt_tokens=10,
            decision=RouteDecision("p1", "paged", "stable", "reuse_low", 0.0, 0))
    body = (await client.get("/admin/decisions?limit=5", headers=AUTH)).json()["decisions"]
    assert [d["request_id"] for d in body] == ["r59", "r58", "r57", "r56", "r55"]
    assert body[0]["reason"] == "reuse_low"
    assert len((await client.get("/admin/decisions?limit=1000", headers=AUTH)).json()["decisions"]) == 50


async def test_canary_policy_needs_existing_variants(client, backend):
    policy = {"canary": "canary", "baseline": "stable", "window_s": 30, "min_requests": 5}
    r = await client.put("/admin/models/m/canary-policy", json=policy, headers=AUTH)
    assert r.status_code == 400 and "no variant" in r.json()["error"]["message"]
    await client.put("/admin/models/m/routing", json=GOOD, headers=AUTH)
    r = await client.put("/admin/models/m/canary-policy", json=policy, headers=AUTH)
    assert r.status_code == 200 and backend.rollback.policies["m"].window_s == 30
    r = await client.put("/admin/models/m/canary-policy", json={**policy, "window_s": -1}, headers=AUTH)
    assert r.status_code == 400
    r = await client.put("/admin/models/m/canary-policy", json={**policy, "window_s": 3600}, headers=AUTH)
    assert r.status_code == 400 and "at most 300 s" in r.json()["error"]["message"]
    r = await client.get("/admin/models/m/canary-policy", headers=AUTH)
    assert r.json()["policy"]["window_s"] == 30 and r.json()["rolled_back"] is False
    assert (await client.delete("/admin/models/m/canary-policy", headers=AUTH)).json() == {"policy": None}
    assert "m" not in backend.rollback.policies


async def test_stream_event_carries_what_the_dashboard_draws(backend):
    for i in range(20):
        backend.stats.record(model="m", ok=i % 10 != 0, engine_kind="paged" if i % 2 else "prefix",
                             variant="stable", worker_id="p1", reason="reuse_low", ttft_s=0.05, itl_s=0.02,
                             output_tokens=8)
    ev = await stream_event(backend)
    s = ev["stats"]
    assert s["requests"] == 20 and s["errors"] == 2 and s["rps"] == pytest.approx(2.0)
    assert s["ttft_p99_ms"] == pytest.approx(50.0) and s["itl_p50_ms"] == pytest.approx(20.0)
    assert set(s["by_engine"]) == {"paged", "prefix"} and s["by_reason"] == {"reuse_low": 20}
    assert s["output_tokens_per_s"] == pytest.approx(16.0)
    assert ev["workers"][1]["prefix_hit_rate"] == 0.6 and "m" in ev["routing"]
    assert ev["rollback"] == {"events": [], "policies": {}, "status": {}}


async def test_dashboard_page_and_vendored_chart_library_are_served(client):
    page = await client.get("/dashboard")
    assert page.status_code == 200 and "/dashboard/vendor/chart.umd.min.js" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # works offline
    lib = await client.get("/dashboard/vendor/chart.umd.min.js")
    assert lib.status_code == 200 and "Chart.js v4" in lib.text[:200]
    assert (await client.get("/dashboard/vendor/chart.js.LICENSE.md")).status_code == 200
    assert (await client.get("/dashboard/../admin.py")).status_code == 404


@pytest.mark.parametrize("weights", [
    ("Infinity", "10"), ("1e400", "10"), ("NaN", "10"), ('"NaN"', "10"), ('"inf"', "10"), ("90", "-Infinity"),
])
async def test_non_finite_weights_are_refused_and_change_nothing(client, backend, weights):
    """Issue 14: an Infinity/1e400/NaN weight answered 500 but was stored, and from then on GET routing and
    GET audit answered 500. Now the write is a 400 and the state is exactly what it was."""
    assert (await client.put("/admin/models/m/routing", json=GOOD, headers=AUTH)).status_code == 200
    raw = json.dumps(GOOD).replace('"weight": 90', f'"weight": {weights[0]}').replace('"weight": 10',
                                                                                       f'"weight": {weights[1]}')
    r = await client.put("/admin/models/m/routing", content=raw.encode(), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "finite" in r.json()["error"]["message"]
    got = await client.get("/admin/models/m/routing", headers=AUTH)
    assert got.status_code == 200 and [v["weight"] for v in got.json()["variants"]] == [90.0, 10.0]
    audit = await client.get("/admin/audit", headers=AUTH)
    assert audit.status_code == 200 and len(audit.json()["entries"]) == 1


@pytest.mark.parametrize("change", [
    {"window_s": "nan"}, {"max_ttft_p99_ratio": "inf"}, {"confirm_s": "NaN"},
    {"ramp": [{"weight": "nan", "hold_s": 10}]}, {"ramp": [{"weight": 10, "hold_s": "inf"}]},
])
async def test_non_finite_canary_policy_is_refused_and_changes_nothing(client, backend, change):
    await client.put("/admin/models/m/routing", json=GOOD, headers=AUTH)
    policy = {"canary": "canary", "baseline": "stable", "window_s": 30, "min_requests": 5}
    assert (await client.put("/admin/models/m/canary-policy", json=policy, headers=AUTH)).status_code == 200
    r = await client.put("/admin/models/m/canary-policy", json={**policy, **change}, headers=AUTH)
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
    got = await client.get("/admin/models/m/canary-policy", headers=AUTH)
    assert got.status_code == 200 and got.json()["policy"]["window_s"] == 30
    assert (await stream_event(backend))["rollback"]["policies"]["m"]["window_s"] == 30
