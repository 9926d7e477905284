"""Admission control's estimate and decision (gateway/serving/admission.py), no I/O."""

from __future__ import annotations

import dataclasses

import pytest

from gateway import errors
from gateway.routing.policy import capable, route
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import Pool, RouteRequest, RoutingConfig, Variant, WorkerView
from gateway.serving.admission import WaitEstimate, best_wait, check_wait, queue_wait_s


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
