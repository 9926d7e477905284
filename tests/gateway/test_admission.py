"""Admission control's estimate and decision (gateway/serving/admission.py), no I/O."""

from __future__ import annotations

import dataclasses

import pytest

from gateway import errors
from gateway.control.limits import CRITICAL, SHEDDABLE, STANDARD
from gateway.routing.policy import capable, route
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import Pool, RouteRequest, RoutingConfig, Variant, WorkerView
from gateway.serving.admission import (
    TenantShare,
    WaitEstimate,
    best_wait,
    check_wait,
    queue_wait_s,
    request_band,
    tenant_share,
)


def view(worker_id: str, queued: int, healthy: bool = True, caps=("logprobs",), model: str = "m") -> WorkerView:
    return WorkerView(worker_id=worker_id, model_id=model, engine_kind="paged", version="v1",
                      capabilities=frozenset(caps), healthy=healthy, draining=False, num_running=1,
                      num_waiting=0, kv_usage=0.1, queued_prefill_tokens=queued)


def test_the_wait_is_the_queued_prefill_over_the_measured_rate():
    assert queue_wait_s(0, 0.0) == 0.0  # nothing queued: no wait, measured or not
    assert queue_wait_s(30_000, 100.0) == 300.0
    assert queue_wait_s(30_000, 0.0) is None  # no rate measured yet: unknown


def test_the_least_busy_capable_worker_sets_the_wait():
    candidates = [(view("a", 9000), 100.0), (view("b", 1000), 100.0), (view("c", 0, healthy=False), 100.0),
                  (view("d", 0, caps=()), 100.0), (view("e", 0, model="other"), 100.0)]
    assert best_wait(candidates, "m", frozenset({"logprobs"})) == WaitEstimate("b", 10.0)
    assert best_wait(candidates + [(view("f", 500), 0.0)], "m") is None  # one without an estimate: admit
    assert best_wait([], "m") is None


def test_over_the_bound_is_a_429_with_retry_after():
    check_wait(WaitEstimate("a", 9.0), 10.0, None)
    check_wait(WaitEstimate("a", 99.0), None, None)  # no bound at all
    check_wait(None, 1.0, 1.0)  # no estimate: admitted
    with pytest.raises(errors.QueueWaitTooLong) as e:
        check_wait(WaitEstimate("a", 12.2), 10.0, None)
    assert e.value.status == 429 and e.value.headers == {"retry-after": "3"}
    assert "max_queue_wait_s of 10 s" in e.value.message
    payload = errors.error_payload(e.value)["error"]
    assert payload["type"] == "rate_limit_exceeded" and payload["code"] == "queue_wait_exceeded"


def test_the_client_s_timeout_lowers_the_bound():
    with pytest.raises(errors.QueueWaitTooLong) as e:
        check_wait(WaitEstimate("a", 8.0), 600.0, 5.0)
    assert "the client's timeout of 5 s" in e.value.message and e.value.headers == {"retry-after": "3"}


def test_the_wait_is_the_requests_canary_arms_as_routing_would_pick():
    """Admission asks the Router's `capable`, the routing policy's own steps 1-3: a request pinned to the canary
    waits behind the canary's queue, not the idle stable workers' (the copy admission had ignored the arm)."""
    config = RoutingConfig(variants=(Variant("stable", (Pool("paged", "v1"),), 0.5),
                                     Variant("canary", (Pool("paged", "v2"),), 0.5)))
    stable = view("s", 0)
    canary = dataclasses.replace(view("c", 10_000), version="v2")
    pinned = RouteRequest(model="m", block_hashes=(1,), num_prompt_tokens=20, variant_override="canary")
    assert [w.worker_id for w in capable(pinned, [stable, canary], config)] == ["c"]
    assert best_wait([(stable, 100.0), (canary, 100.0)], "m", request=pinned, config=config) == WaitEstimate("c", 100.0)
    # an unknown variant or a missing capability: nobody can serve it, admitted (routing answers 400 / 503)
    assert capable(dataclasses.replace(pinned, variant_override="nightly"), [stable, canary], config) == []
    assert capable(dataclasses.replace(pinned, required_capabilities=frozenset({"beam_search"})),
                   [stable, canary], config) == []
    # sticky arms: every session's capable workers are exactly its arm, the one route() picks from
    for i in range(50):
        r = dataclasses.replace(pinned, variant_override=None, session_key=f"s{i}")
        (able,) = capable(r, [stable, canary], config)
        arm = route(r, [stable, canary], config, None, SeenBlocks(), WorkerBlockIndex()).variant
        assert able.worker_id == ("c" if arm == "canary" else "s")


# -- flow control: priority bands and fairness across API keys (issue 45) ---------------------------------

def test_a_tenant_under_its_equal_share_is_admitted_past_the_bound_and_the_heavy_one_is_refused():
    busy = WaitEstimate("a", 14.0)  # a heavy tenant filled the queue past the 10 s bound
    light = tenant_share("light", {"heavy": 1300, "light": 0}, [100.0])
    assert light == TenantShare(0.0, 2)
    check_wait(busy, 10.0, None, STANDARD, light)  # 0 s of its own, under 10 / 2: admitted
    heavy = tenant_share("heavy", {"heavy": 1300, "light": 100}, [100.0])
    with pytest.raises(errors.QueueWaitTooLong) as e:
        check_wait(busy, 10.0, None, STANDARD, heavy)
    assert "over its equal share (5.0 s among 2 API keys" in e.value.message
    assert e.value.headers == {"retry-after": "8"}  # 13 s of its own, 5 s its share
    # alone, a tenant's own wait is the whole queue's: the plain bound (the behaviour before flow control)
    with pytest.raises(errors.QueueWaitTooLong):
        check_wait(busy, 10.0, None, STANDARD, tenant_share(None, {None: 1400}, [100.0]))
    assert tenant_share("x", {"y": 10}, [100.0, 0.0]) is None  # a worker without a measured rate: no share


def test_sheddable_work_is_refused_first_and_critical_work_only_by_its_client_s_timeout():
    half_full = WaitEstimate("a", 6.0)
    check_wait(half_full, 10.0, None, STANDARD)
    with pytest.raises(errors.QueueWaitTooLong) as e:
        check_wait(half_full, 10.0, None, SHEDDABLE)
    assert "half of max_queue_wait_s, for sheddable work" in e.value.message and e.value.headers == {"retry-after": "1"}
    check_wait(WaitEstimate("a", 99.0), 10.0, None, CRITICAL)
    with pytest.raises(errors.QueueWaitTooLong):
        check_wait(WaitEstimate("a", 99.0), 10.0, 30.0, CRITICAL)


def test_a_request_may_lower_its_band_never_raise_it():
    assert request_band(STANDARD, None) == STANDARD
    assert request_band(STANDARD, "Sheddable") == SHEDDABLE
    assert request_band(SHEDDABLE, "critical") == SHEDDABLE
    assert request_band(CRITICAL, "standard") == STANDARD
    with pytest.raises(errors.InvalidRequest) as e:
        request_band(STANDARD, "urgent")
    assert e.value.param == "x-duet-band" and e.value.status == 400


async def test_bands_and_equal_shares_through_the_gateway(fake_gateway, monkeypatch):
    """The wiring: the API key is the tenant, `x-duet-band` lowers a band and never raises it, refusals are counted
    per band. One worker measuring 100 prefill tokens/s holds a 150-token prompt of key a that never starts:
    1.5 s of queue against a 1 s bound."""
    import asyncio

    from tests.support.fake_engine import FakeEngine, Hang
    from tests.support.stack import model_dir

    engine = FakeEngine("paged")
    measured = engine.client.get_load

    async def get_load(timeout=None):
        load = await measured(timeout)
        load.prefill_tokens_per_s = 100.0
        return load

    monkeypatch.setattr(engine.client, "get_load", get_load)
    gw = await fake_gateway(engine, auth={"api_keys": ["sk-a", "sk-b"]}, limits={"max_queue_wait_s": 1.0})
    g = gw.gateway
    while not (g.fleet.get(engine.worker_id).load and g.fleet.get(engine.worker_id).load.prefill_tokens_per_s):
        await asyncio.sleep(0.05)
    model = model_dir().name

    def post(key: str, band: str | None = None):
        headers = {"authorization": f"Bearer {key}", **({"x-duet-band": band} if band else {})}
        return gw.http.post("/v1/completions", headers=headers,
                            json={"model": model, "prompt": [5] * 150, "max_tokens": 1})

    engine.script([Hang()])
    blocker = asyncio.ensure_future(post("sk-a"))
    while g.pool_tracker.queued(engine.worker_id) < 150:
        await asyncio.sleep(0.01)
    try:
        refused = [await post("sk-a"), await post("sk-a", "critical")]  # key a holds the whole queue: refused
        assert [r.status_code for r in refused] == [429, 429], [r.text for r in refused]
        assert "equal share" not in refused[0].json()["error"]["message"]  # alone: the plain bound
        assert (await post("sk-b")).status_code == 200  # key b holds nothing: under its equal share
        shed = await post("sk-b", "sheddable")  # sheddable: refused past half the bound, whoever asks
        assert shed.status_code == 429 and "sheddable" in shed.json()["error"]["message"]
        metrics = (await gw.http.get("/metrics")).text
        assert f'duet_admission_refused_total{{band="standard",model="{model}"}} 2.0' in metrics
        assert f'duet_admission_refused_total{{band="sheddable",model="{model}"}} 1.0' in metrics
    finally:
        blocker.cancel()
