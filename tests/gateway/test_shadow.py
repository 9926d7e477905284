"""Shadow traffic and its gates, below the live stack (test_shadow_live.py runs the whole path on real engines):
the pure gate check, the shadow's config and books, the mirror inside the real gateway app over fake engines
(a copy never delays the user's answer, its cap and the load drop it first, greedy agreement), the rollback
controller checking the same gates during a ramp and promoting at its end."""

import asyncio
import time

import httpx
import pytest

from gateway.control.gates import Figures, GateError, Gates, check
from gateway.control.rollback import CanaryPolicy, RollbackController, judge
from gateway.control.shadow import PRIMARY, SHADOW, ShadowConfig, ShadowError, ShadowLedger
from gateway.control.state.memory import MemoryStore
from gateway.control.stats import RequestStats, WindowStats
from gateway.routing.route_types import Pool, RoutingConfig, Variant
from gateway.serving import mirror
from tests.support.fake_engine import Delay, FakeEngine, Hang, Started, Tokens
from tests.support.stack import GatewayThread, Sim, gateway_config, start_sims

KEY = "adm-shadow"
AUTH = {"Authorization": f"Bearer {KEY}"}


def figures(n=50, errors=0, ttft=0.05, tpot=0.01, compared=0, agreed=0):
    return Figures(n, errors, ttft, ttft * 2, tpot, tpot * 2, compared, agreed)


# ---- the gate check ----

def test_a_slow_candidate_fails_with_the_figures_named():
    v = check(Gates(), figures(ttft=0.2, tpot=0.05, compared=10, agreed=10), figures(compared=0))
    assert not v.passed and v.enough_data
    assert v.failures[0].startswith("TTFT p50 4.00x the primary's (200.0 vs 50.0 ms; bound 1.5x)")
    assert any(f.startswith("TPOT p99 5.00x") for f in v.failures)


def test_gates_wait_for_requests_and_greedy_pairs():
    v = check(Gates(min_requests=20), figures(n=19), figures())
    assert not v.passed and not v.enough_data and "20 requests on each side (candidate 19" in v.waiting_for
    v = check(Gates(), figures(compared=4, agreed=4), figures())
    assert not v.passed and not v.failures and "5 greedy answers compared (have 4)" in v.waiting_for
    assert check(Gates(), figures(compared=5, agreed=5), figures()).passed


def test_error_rate_and_agreement_bounds_and_a_bound_turned_off():
    v = check(Gates(), figures(errors=5, compared=10, agreed=8), figures(errors=1))
    assert v.failures == ("error rate 10.0% vs the primary's 2.0% (bound +2.0%)",
                          "greedy agreement 80% of 10 (bound 90%)")
    off = Gates.from_dict({"max_error_rate_increase": None, "min_greedy_agreement": None})
    assert check(off, figures(errors=5), figures(errors=1)).passed


def test_gates_from_json_refuse_what_cannot_apply():
    with pytest.raises(GateError, match="unknown gate.*max_ttft_ratio"):
        Gates.from_dict({"max_ttft_ratio": 2})
    with pytest.raises(GateError, match="max_tpot_p50_ratio must be > 0"):
        Gates.from_dict({"max_tpot_p50_ratio": 0})
    with pytest.raises(GateError, match="min_requests must be an integer >= 1"):
        Gates.from_dict({"min_requests": 0.5})
    assert Gates.from_dict(Gates(max_ttft_p50_ratio=1.2).to_dict()) == Gates(max_ttft_p50_ratio=1.2)


# ---- the shadow's config and books ----

def test_shadow_config_names_the_bad_field():
    with pytest.raises(ShadowError, match="pools: the candidate"):
        ShadowConfig.from_dict("m", {"share": 0.5}, 300)
    with pytest.raises(ShadowError, match=r"share must be within \(0, 1\]"):
        ShadowConfig.from_dict("m", {"pools": [{"engine_kind": "paged"}], "share": 0}, 300)
    with pytest.raises(ShadowError, match="window_s must be within"):
        ShadowConfig.from_dict("m", {"pools": [{"engine_kind": "paged"}], "window_s": 600}, 300)
    with pytest.raises(ShadowError, match="unknown gate"):
        ShadowConfig.from_dict("m", {"pools": [{"engine_kind": "paged"}], "gates": {"p50": 1}}, 300)
    c = ShadowConfig.from_dict("m", {"pools": [{"engine_kind": "paged", "version": "v2"}], "share": 1}, 300)
    assert c.pools == (Pool("paged", "v2"),) and c.share == 1.0
    assert ShadowConfig.from_dict("m", c.to_dict(), 300) == c


def test_the_books_keep_each_side_per_class_within_the_window():
    now = [1000.0]
    ledger = ShadowLedger(clock=lambda: now[0])
    ledger.set_config(ShadowConfig("m", (Pool("paged", "v2"),), window_s=60))
    ledger.record("m", PRIMARY, "oneshot", True, 0.9, 0.9)  # leaves the window below
    now[0] += 61
    for i in range(4):
        ledger.record("m", PRIMARY, "oneshot" if i % 2 else "session", True, 0.01 * (i + 1), 0.002)
        ledger.record("m", SHADOW, "oneshot" if i % 2 else "session", i != 3, 0.02 * (i + 1), 0.004)
    ledger.compared("m", "oneshot", True)
    ledger.compared("m", "session", False)
    report = ledger.report("m")
    assert report["primary"]["requests"] == 4 and report["primary"]["ttft_p99_ms"] == 40.0
    assert report["shadow"]["errors"] == 1 and report["shadow"]["greedy_agreement"] == 0.5
    assert report["by_class"]["oneshot"]["shadow"]["requests"] == 2
    assert report["by_class"]["session"]["shadow"]["greedy_agreement"] == 0.0
    assert ledger.gate_error("m").startswith("the shadow's candidate paged@v2 has not been measured enough")
    ledger.set_config(ShadowConfig("m", (Pool("paged", "v3"),)))  # a new candidate starts afresh
    assert ledger.report("m")["shadow"]["requests"] == 0


# ---- the mirror in the real gateway app ----

ROUTING = {"variants": [{"name": "primary", "weight": 100, "pools": [{"engine_kind": "prefix", "version": "v1"}]},
                        {"name": "candidate", "weight": 0, "pools": [{"engine_kind": "paged", "version": "v2"}]}]}


async def start_shadow(gw, **fields):
    r = await gw.http.put(f"/admin/models/{model(gw)}/shadow", headers=AUTH,
                          json={"pools": [{"engine_kind": "paged", "version": "v2"}], "share": 1, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def model(gw):
    return next(iter(gw.gateway.models))


def greedy(gw, text="hello", max_tokens=4):
    return {"model": model(gw), "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}


async def test_a_copy_that_hangs_never_delays_the_answer_and_its_cap_drops_the_next(fake_gateway):
    candidate = FakeEngine("paged", "cand", version="v2").script([Started(), Hang()])
    gw = await fake_gateway(FakeEngine("prefix", "prim"), candidate, routing=ROUTING, auth={"admin_key": KEY})
    await start_shadow(gw, max_concurrency=1)
    r = await asyncio.wait_for(gw.http.post("/v1/chat/completions", json=greedy(gw)), 5)
    assert r.status_code == 200 and r.headers["x-duet-worker"] == "prim"
    assert await gw.wait_for(lambda: len(candidate.open_streams) == 1)  # the copy is still hanging there
    r = await gw.http.post("/v1/chat/completions", json=greedy(gw, "again"))
    assert r.status_code == 200 and len(candidate.requests) == 1  # at the cap: no second copy
    report = (await gw.http.get(f"/admin/models/{model(gw)}/shadow", headers=AUTH)).json()["shadow"]
    assert report["in_flight"] == 1 and report["dropped"]["cap"] == 1
    assert candidate.requests[0].request_id.endswith("-shadow")


async def test_no_copy_starts_while_the_gateway_is_loaded(fake_gateway):
    candidate = FakeEngine("paged", "cand", version="v2")
    gw = await fake_gateway(FakeEngine("prefix", "prim"), candidate, routing=ROUTING, auth={"admin_key": KEY},
                            limits={"max_pending_requests": 4})
    await start_shadow(gw, drop_above_pending=0.25)  # 1 of 4 in flight: the request itself is enough
    assert (await gw.http.post("/v1/chat/completions", json=greedy(gw))).status_code == 200
    report = (await gw.http.get(f"/admin/models/{model(gw)}/shadow", headers=AUTH)).json()["shadow"]
    assert report["dropped"]["load"] == 1 and not candidate.requests


async def test_no_copy_starts_while_the_event_loop_runs_late(fake_gateway, monkeypatch):
    monkeypatch.setattr(mirror, "LAG_PROBE_S", 3600.0)  # the test sets the lag itself
    candidate = FakeEngine("paged", "cand", version="v2")
    gw = await fake_gateway(FakeEngine("prefix", "prim"), candidate, routing=ROUTING, auth={"admin_key": KEY})
    await start_shadow(gw, max_loop_lag_ms=20)
    gw.gateway.mirror.loop_lag_s = 0.05  # a gateway short of CPU: its loop wakes 50 ms late
    assert (await gw.http.post("/v1/chat/completions", json=greedy(gw))).status_code == 200
    gw.gateway.mirror.loop_lag_s = 0.005
    assert (await gw.http.post("/v1/chat/completions", json=greedy(gw, "later"))).status_code == 200
    report = (await gw.http.get(f"/admin/models/{model(gw)}/shadow", headers=AUTH)).json()["shadow"]
    assert report["dropped"]["lag"] == 1 and len(candidate.requests) == 1


async def test_a_request_the_candidate_cannot_serve_is_counted_not_copied(fake_gateway):
    candidate = FakeEngine("paged", "cand", version="v2")  # engine_paged: no structured output
    gw = await fake_gateway(FakeEngine("prefix", "prim"), candidate, routing=ROUTING, auth={"admin_key": KEY})
    await start_shadow(gw)
    body = {**greedy(gw), "response_format": {"type": "json_object"}}
    assert (await gw.http.post("/v1/chat/completions", json=body)).status_code == 200
    report = (await gw.http.get(f"/admin/models/{model(gw)}/shadow", headers=AUTH)).json()["shadow"]
    assert report["dropped"]["incapable"] == 1 and not candidate.requests


async def test_greedy_answers_are_compared_token_by_token(fake_gateway):
    # the sim answers a prompt with the same tokens on any worker; the scripted call says something else
    candidate = FakeEngine("paged", "cand", version="v2").script([Tokens([7, 8, 9, 10], finish="length")])
    gw = await fake_gateway(FakeEngine("prefix", "prim"), candidate, routing=ROUTING, auth={"admin_key": KEY})
    await start_shadow(gw)
    for text in ("first", "second"):
        assert (await gw.http.post("/v1/chat/completions", json=greedy(gw, text))).status_code == 200
    ledger = gw.gateway.shadow
    assert await gw.wait_for(lambda: ledger.agreement(model(gw), 60) == (2, 1)), ledger.agreement(model(gw), 60)
    report = (await gw.http.get(f"/admin/models/{model(gw)}/shadow", headers=AUTH)).json()
    assert report["shadow"]["shadow"]["requests"] == 2 and report["shadow"]["primary"]["requests"] == 2
    assert report["sampling_defaults"]["differences"] == [
        {"field": "speculative_greedy", "primary": {"prefix@v1": True}, "candidate": {"paged@v2": False}}]


async def test_a_late_copy_of_the_old_candidate_stays_out_of_the_new_ones_books(fake_gateway):
    old = FakeEngine("paged", "old", version="v2").script([Delay(0.3), Tokens([5], finish="length")])
    new = FakeEngine("paged", "new", version="v3")
    routing = {"variants": [*ROUTING["variants"], {"name": "next", "weight": 0,
                                                   "pools": [{"engine_kind": "paged", "version": "v3"}]}]}
    gw = await fake_gateway(FakeEngine("prefix", "prim"), old, new, routing=routing, auth={"admin_key": KEY})
    await start_shadow(gw)
    assert (await gw.http.post("/v1/chat/completions", json=greedy(gw))).status_code == 200
    r = await gw.http.put(f"/admin/models/{model(gw)}/shadow", headers=AUTH,
                          json={"pools": [{"engine_kind": "paged", "version": "v3"}], "share": 1})
    assert r.status_code == 200, r.text
    assert await gw.wait_for(lambda: not old.open_streams)  # the old candidate's copy has finished
    report = (await gw.http.get(f"/admin/models/{model(gw)}/shadow", headers=AUTH)).json()["shadow"]
    assert report["shadow"]["requests"] == 0 and report["primary"]["requests"] == 0


async def test_a_candidate_with_live_traffic_is_refused(fake_gateway):
    gw = await fake_gateway(FakeEngine("prefix", "prim"), FakeEngine("paged", "cand", version="v2"),
                            auth={"admin_key": KEY})  # no variants: every pool takes live traffic
    r = await gw.http.put(f"/admin/models/{model(gw)}/shadow", headers=AUTH,
                          json={"pools": [{"engine_kind": "paged", "version": "v2"}]})
    assert r.status_code == 400 and "the candidate takes live traffic now (cand)" in r.json()["error"]["message"]
    r = await gw.http.post(f"/admin/models/{model(gw)}/canary/start", headers=AUTH)
    assert r.status_code == 400 and "no shadow runs" in r.json()["error"]["message"]


# ---- the same gates during the ramp, and promotion ----

def test_judge_breaches_on_a_gate_the_old_bounds_do_not_cover():
    policy = CanaryPolicy("m", "canary", "stable", min_requests=20, gates=Gates(min_requests=20))
    slow_tokens = WindowStats(120.0, 50, 0, 0.05, 0.06, 0.05, 0.06, 500)  # TPOT 5x, TTFT equal
    base = WindowStats(120.0, 50, 0, 0.05, 0.06, 0.01, 0.012, 500)
    v = judge(policy, slow_tokens, base, greedy=(10, 10))
    assert v.breach and v.message.startswith("gate failed over 120 s: TPOT p50 5.00x")
    assert not judge(CanaryPolicy("m", "canary", "stable"), slow_tokens, base).breach  # without gates


async def test_a_ramp_that_ends_at_100_percent_promotes():
    store = MemoryStore()
    await store.put_routing("m", RoutingConfig(variants=(
        Variant("stable", (Pool("paged", "v1"),), 100.0), Variant("canary", (Pool("paged", "v2"),), 0.0))), "test")
    rb = RollbackController(store, RequestStats(), shadow=ShadowLedger())
    rb.set_policy(CanaryPolicy.from_dict("m", {"canary": "canary", "baseline": "stable", "gates": {},
                                               "ramp": [{"weight": 50, "hold_s": 5}, {"weight": 100, "hold_s": 5}]}))
    for now in (0.0, 5.0, 9.0):
        await rb.tick(now)
    assert not rb.status("m")["promoted"]  # the last step has not held yet
    await rb.tick(10.0)
    assert rb.status("m")["promoted"]
    assert (await store.audit_log(1))[0]["actor"].startswith("canary promoted: canary serves 100%")
    assert [v.weight for v in (await store.get_routing("m")).variants] == [0.0, 100.0]


# ---- an external backend as the candidate ----

def test_an_external_backend_shadows_the_primary_and_its_defaults_are_reported(tmp_path):
    """The candidate is an `openai` backend pool (another Duet gateway over a sim, real HTTP and SSE): the
    copies reach it through gateway/backends/http_backend.py, and the report says which sampling defaults the
    backend chooses itself."""
    primary, inner_sim = start_sims([Sim("paged", worker_id="prim", version="v1"), Sim("paged")], tmp_path)
    inner = GatewayThread(gateway_config([inner_sim])).start()
    outer = None
    try:
        routing = {"variants": [
            {"name": "primary", "weight": 100, "pools": [{"engine_kind": "paged", "version": "v1"}]},
            {"name": "candidate", "weight": 0, "pools": [{"engine_kind": "paged", "version": "external"}]}]}
        outer = GatewayThread(gateway_config([primary], backends=[{"engine": "openai", "url": inner.url}],
                                             routing=routing, auth={"admin_key": KEY})).start(wait_workers=2)
        m = next(iter(outer.gateway.models))
        with httpx.Client(base_url=outer.url, timeout=30) as c:
            r = c.put(f"/admin/models/{m}/shadow", headers=AUTH, json={
                "pools": [{"engine_kind": "paged", "version": "external"}], "share": 1, "max_loop_lag_ms": 1000})
            assert r.status_code == 200, r.text
            for i in range(6):
                body = {"model": m, "temperature": 0, "max_tokens": 5,
                        "messages": [{"role": "user", "content": f"question {i}"}]}
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.headers["x-duet-worker"] == "prim"
            end = time.monotonic() + 20  # the copies finish after the answers
            while (answer := c.get(f"/admin/models/{m}/shadow", headers=AUTH).json())["shadow"]["shadow"][
                    "requests"] < 6 and time.monotonic() < end:
                time.sleep(0.1)
        assert answer["shadow"]["shadow"]["requests"] == 6 and answer["shadow"]["shadow"]["errors"] == 0, answer
        assert {"field": "top_k", "primary": {"paged@v1": None},
                "candidate": {"openai@external": "the server's own"}} in answer["sampling_defaults"]["differences"]
    finally:
        if outer is not None:
            outer.stop()
        inner.stop()
        for s in (primary, inner_sim):
            s.kill()
