"""Automatic canary analysis: the pure judgement, and the controller against the real in-memory store
with an injected clock (the end-to-end version with sim workers lives in test_rollback_live.py)."""

import pytest

from gateway.control.rollback import CanaryPolicy, PolicyError, RollbackController, judge
from gateway.control.state.memory import MemoryStore
from gateway.control.stats import RequestStats, WindowStats
from gateway.routing.route_types import Pool, RoutingConfig, Variant


def ws(count, errors=0, p99=0.1):
    return WindowStats(120.0, count, errors, p99, p99, 0.01, 0.01, count * 10)


POLICY = CanaryPolicy(model="m", canary="canary", baseline="stable", window_s=120, min_requests=20,
                      max_ttft_p99_ratio=2.0, max_error_rate_increase=0.05, confirm_s=0)


def test_judge_needs_minimum_requests():
    v = judge(POLICY, ws(19, errors=19), ws(100))
    assert not v.breach and not v.enough_data


def test_judge_slow_canary_message_names_ratio_and_window():
    v = judge(POLICY, ws(50, p99=0.24), ws(50, p99=0.1))
    assert v.breach
    assert v.message == "TTFT p99 2.4x baseline over 120 s"


def test_judge_failing_canary_vs_baseline_error_rate():
    assert judge(POLICY, ws(100, errors=10), ws(100, errors=0)).message.startswith("error rate 10% vs baseline 0%")
    # the same error rate on both arms is not the canary's fault
    assert not judge(POLICY, ws(100, errors=10), ws(100, errors=10)).breach


def test_judge_healthy_canary_within_bounds():
    v = judge(POLICY, ws(100, p99=0.15), ws(100, p99=0.1))
    assert v.enough_data and not v.breach


def test_policy_from_dict_rejects_bad_input():
    with pytest.raises(PolicyError, match="unknown"):
        CanaryPolicy.from_dict("m", {"canary": "a", "baseline": "b", "bogus": 1})
    with pytest.raises(PolicyError, match="different"):
        CanaryPolicy.from_dict("m", {"canary": "a", "baseline": "a"})
    with pytest.raises(PolicyError, match="ramp"):
        CanaryPolicy.from_dict("m", {"canary": "a", "baseline": "b", "ramp": [{"weight": 200, "hold_s": 1}]})
    p = CanaryPolicy.from_dict("m", {"canary": "a", "baseline": "b", "ramp": [{"weight": 5, "hold_s": 60}]})
    assert p.ramp[0].weight == 5 and CanaryPolicy.from_dict("m", p.to_dict()) == p


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def two_arms(canary_weight=20.0):
    return RoutingConfig(variants=(
        Variant("stable", (Pool("paged", "v1"),), 100.0 - canary_weight),
        Variant("canary", (Pool("paged", "v2"),), canary_weight),
    ))


def feed(stats, variant, n, ttft, ok=True):
    for _ in range(n):
        stats.record(model="m", ok=ok, engine_kind="paged", variant=variant, ttft_s=ttft, output_tokens=4)


async def setup(policy):
    clock = Clock()
    store = MemoryStore()
    stats = RequestStats(clock=clock)
    await store.put_routing("m", two_arms(), "admin-test")
    ctl = RollbackController(store=store, stats=stats, clock=clock)
    ctl.set_policy(policy)
    return clock, store, stats, ctl


async def weights(store):
    return {v.name: v.weight for v in (await store.get_routing("m")).variants}


async def test_slow_canary_is_rolled_back_after_confirm_and_audited():
    policy = CanaryPolicy(model="m", canary="canary", baseline="stable", window_s=30, min_requests=10,
                          max_ttft_p99_ratio=2.0, confirm_s=5)
    clock, store, stats, ctl = await setup(policy)
    feed(stats, "stable", 40, 0.05)
    feed(stats, "canary", 20, 0.2)
    await ctl.tick()
    assert (await weights(store))["canary"] == 20.0  # breach seen, not yet confirmed
    clock.now += 6
    await ctl.tick()
    assert await weights(store) == {"stable": 80.0, "canary": 0.0}
    entry = (await store.audit_log(1))[0]
    assert entry["actor"] == "automatic rollback: TTFT p99 4.0x baseline over 30 s"
    assert entry["before"]["variants"][1]["weight"] == 20.0 and entry["after"]["variants"][1]["weight"] == 0.0
    assert ctl.registry.get_sample_value("duet_canary_rollbacks_total", {"model": "m", "variant": "canary"}) == 1
    assert ctl.events[-1]["message"].startswith("automatic rollback")
    assert ctl.status("m")["rolled_back"]


async def test_breach_that_recovers_before_confirm_does_not_roll_back():
    policy = CanaryPolicy(model="m", canary="canary", baseline="stable", window_s=10, min_requests=10, confirm_s=5)
    clock, store, stats, ctl = await setup(policy)
    feed(stats, "stable", 20, 0.05)
    feed(stats, "canary", 20, 0.5)
    await ctl.tick()
    clock.now += 11  # the bad samples leave the window
    feed(stats, "stable", 20, 0.05)
    feed(stats, "canary", 20, 0.06)
    await ctl.tick()
    clock.now += 10
    feed(stats, "canary", 20, 0.06)
    feed(stats, "stable", 20, 0.05)
    await ctl.tick()
    assert (await weights(store))["canary"] == 20.0 and not ctl.events


async def test_healthy_canary_walks_the_ramp_and_a_failing_one_stops_it():
    policy = CanaryPolicy.from_dict("m", {
        "canary": "canary", "baseline": "stable", "window_s": 60, "min_requests": 10, "confirm_s": 0,
        "ramp": [{"weight": 5, "hold_s": 10}, {"weight": 25, "hold_s": 10}, {"weight": 50, "hold_s": 0}],
    })
    clock, store, stats, ctl = await setup(policy)
    await ctl.tick()
    assert await weights(store) == {"stable": 95.0, "canary": 5.0}
    clock.now += 5
    await ctl.tick()
    assert (await weights(store))["canary"] == 5.0  # still holding
    clock.now += 6
    feed(stats, "stable", 20, 0.05)
    feed(stats, "canary", 20, 0.05)
    await ctl.tick()
    assert (await weights(store))["canary"] == 25.0
    assert (await store.audit_log(1))[0]["actor"] == "canary ramp: step 2/3, canary at 25%"
    feed(stats, "canary", 30, 0.05, ok=False)
    clock.now += 20
    await ctl.tick()
    assert (await weights(store))["canary"] == 0.0
    clock.now += 20
    await ctl.tick()
    assert (await weights(store))["canary"] == 0.0  # the ramp does not resume after a rollback
