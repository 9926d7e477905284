"""The pool planner (gateway/control/pool_planner.py): the split follows the work, never flaps, never
starves a kind that has traffic."""

from __future__ import annotations

import pytest

from gateway.control.pool_planner import PlannerConfig, PoolPlanner, WorkMeter, balanced_split, kind_work


def test_the_split_is_proportional_to_the_work_with_one_worker_for_each_busy_kind():
    assert balanced_split({"paged": 3000.0, "prefix": 1000.0}, 4) == {"paged": 3, "prefix": 1}
    assert balanced_split({"paged": 100.0, "prefix": 9900.0}, 4) == {"paged": 1, "prefix": 3}  # never 0
    assert balanced_split({"paged": 0.0, "prefix": 50.0}, 4) == {"paged": 0, "prefix": 4}
    assert balanced_split({"paged": 0.0, "prefix": 0.0}, 4) is None
    with pytest.raises(ValueError):
        balanced_split({"paged": 1.0}, 0)


def test_work_counts_uncached_prefill_decode_and_the_queued_backlog():
    cfg = PlannerConfig(decode_token_cost=4.0, drain_s=10.0)
    assert kind_work(1000.0, 100.0, 5000, cfg) == 1000 + 400 + 500


def test_the_meter_averages_over_its_window_and_forgets_old_work():
    m = WorkMeter(window_s=10.0)
    m.record("paged", 0.0, 5000, 100)
    m.record("prefix", 5.0, 1000, 0)
    rates = m.rates(10.0)
    assert rates["paged"] == (500.0, 10.0) and rates["prefix"] == (100.0, 0.0)
    assert m.rates(30.0)["paged"] == (0.0, 0.0)


def test_the_target_moves_with_a_shift_and_holds_against_small_changes():
    p = PoolPlanner(PlannerConfig(hysteresis=0.75, cooldown_s=30.0))
    current = {"paged": 2, "prefix": 2}
    assert p.update(0.0, {"paged": 100.0, "prefix": 100.0}, current) == {"paged": 2, "prefix": 2}
    # paged's share 2.6 of 4: within the hysteresis of the target 2, no change
    assert p.update(10.0, {"paged": 650.0, "prefix": 350.0}, current) == {"paged": 2, "prefix": 2}
    # documents-heavy: paged's share 3.2 -> 3 + 1
    assert p.update(20.0, {"paged": 800.0, "prefix": 200.0}, current) == {"paged": 3, "prefix": 1}
    # sessions-heavy right away: the cooldown holds the target ...
    sessions = {"paged": 100.0, "prefix": 900.0}
    assert p.update(30.0, sessions, {"paged": 3, "prefix": 1}) == {"paged": 3, "prefix": 1}
    # ... until it has passed
    assert p.update(51.0, sessions, {"paged": 3, "prefix": 1}) == {"paged": 1, "prefix": 3}
    assert p.changes == 2


def test_it_never_flaps_on_noise_around_a_boundary():
    p = PoolPlanner(PlannerConfig(hysteresis=0.75, cooldown_s=0.0))
    current = {"paged": 2, "prefix": 2}
    targets = set()
    for i in range(200):  # paged's share oscillates between 2.4 and 2.6 of 4 (rounding alone would flap)
        paged = 600.0 if i % 2 else 620.0
        targets.add(tuple(p.update(float(i), {"paged": paged, "prefix": 1000.0 - paged}, current).values()))
    assert targets == {(2, 2)} and p.changes == 0


def test_a_kind_with_traffic_keeps_a_worker_and_an_idle_kind_gives_its_workers_up():
    p = PoolPlanner(PlannerConfig(cooldown_s=0.0))
    current = {"paged": 3, "prefix": 1}
    # the prefix pool has a trickle (1% of the work): it keeps one worker
    assert p.update(0.0, {"paged": 9900.0, "prefix": 100.0}, current)["prefix"] == 1
    # no paged traffic at all: paged's workers move to prefix
    assert p.update(1.0, {"paged": 0.0, "prefix": 500.0}, current) == {"paged": 0, "prefix": 4}
    # silence: the target stays where it is
    assert p.update(2.0, {"paged": 0.0, "prefix": 0.0}, current) == {"paged": 0, "prefix": 4}


def test_the_report_carries_target_and_current():
    p = PoolPlanner()
    p.update(0.0, {"paged": 1.0, "prefix": 1.0}, {"paged": 1, "prefix": 1})
    r = p.report({"paged": 1, "prefix": 1})
    assert r["target"] == {"paged": 1, "prefix": 1} and r["current"] == {"paged": 1, "prefix": 1}
    with pytest.raises(ValueError):
        PlannerConfig(hysteresis=0.2).validate()


def test_it_holds_the_target_while_warming_up_and_follows_a_resized_fleet():
    p = PoolPlanner(PlannerConfig(cooldown_s=0.0))
    current = {"paged": 2, "prefix": 2}
    assert p.update(0.0, {"paged": 0.0, "prefix": 500.0}, current, hold=True) == current
    # three workers while one restarts: the target is the balanced split of three
    assert p.update(1.0, {"paged": 100.0, "prefix": 500.0}, {"paged": 1, "prefix": 2}) == {"paged": 1, "prefix": 2}
    assert sum(p.update(2.0, {"paged": 100.0, "prefix": 500.0}, current).values()) == 4


def test_a_worker_switching_kinds_does_not_reset_the_target():
    # found by `duet bench compare`: each switch took the fleet from 4 to 3 and back, and each size change
    # recomputed the split from the work of that moment (no hysteresis, no cooldown): the planner flapped
    p = PoolPlanner(PlannerConfig(hysteresis=0.75, cooldown_s=15.0))
    p.update(0.0, {"paged": 500.0, "prefix": 500.0}, {"paged": 2, "prefix": 2})
    assert p.update(20.0, {"paged": 900.0, "prefix": 100.0}, {"paged": 2, "prefix": 2}) == {"paged": 3, "prefix": 1}
    # a prefix worker drains and restarts as paged; meanwhile a burst of sessions swings the work
    burst = {"paged": 300.0, "prefix": 700.0}
    assert p.update(25.0, burst, {"paged": 2, "prefix": 1}) == {"paged": 2, "prefix": 1}  # prefix keeps its one
    assert p.update(30.0, burst, {"paged": 3, "prefix": 1}) == {"paged": 3, "prefix": 1}  # restored on return
    assert p.changes == 1


def test_a_resized_fleet_moves_as_few_workers_as_it_takes():
    from gateway.control.pool_planner import resized

    work = {"paged": 100.0, "prefix": 900.0}
    assert resized({"paged": 2, "prefix": 2}, 3, work) == {"paged": 1, "prefix": 2}  # from the kind above its share
    assert resized({"paged": 1, "prefix": 3}, 3, {"paged": 900.0, "prefix": 100.0}) == {"paged": 1, "prefix": 2}
    assert resized({"paged": 1, "prefix": 1}, 1, {"paged": 0.0, "prefix": 5.0}) == {"paged": 0, "prefix": 1}
    assert resized({"paged": 1, "prefix": 2}, 5, work) == {"paged": 1, "prefix": 4}


def test_running_requests_count_as_traffic_before_any_has_finished():
    from gateway.control.pool_tracker import PoolTracker
    from gateway.metrics import GatewayMetrics
    from gateway.routing.route_types import WorkerView

    def view(wid: str, kind: str, running: int) -> WorkerView:
        return WorkerView(worker_id=wid, model_id="m", engine_kind=kind, version="v1", capabilities=frozenset(),
                          healthy=True, draining=False, num_running=running, num_waiting=0, kv_usage=0.0)

    t = PoolTracker(GatewayMetrics(), PlannerConfig(window_s=10.0, cooldown_s=0.0))
    t.meter.record("prefix", 0.0, 5000, 100)  # sessions have finished; the documents on paged have not
    t.meter.record("prefix", 8.0, 5000, 100)
    views = [view("p", "paged", 3), view("x", "prefix", 1)]
    assert t.tick(5.0, views) == {"paged": 1, "prefix": 1}  # warming up: held
    assert t.tick(11.0, views) == {"paged": 1, "prefix": 1}  # paged keeps its worker: it has traffic
    idle_paged = [view("p", "paged", 0), view("x", "prefix", 1)]
    assert t.tick(12.0, idle_paged) == {"paged": 0, "prefix": 2}  # no traffic at all: the worker moves


def test_zero_workers_of_a_kind_is_a_valid_split_unless_a_request_needs_that_kind():
    p = PoolPlanner(PlannerConfig(cooldown_s=30.0))
    # sessions only, nothing needs engine_paged: the homogeneous fleet (the planner is never held to a split)
    assert p.update(0.0, {"paged": 0.0, "prefix": 500.0}, {"paged": 2, "prefix": 2}) == {"paged": 0, "prefix": 4}
    # n > 1 arrives (only engine_paged serves it): one paged worker at once, inside the cooldown
    assert p.update(5.0, {"paged": 0.0, "prefix": 500.0}, {"paged": 0, "prefix": 4},
                    needed=frozenset({"paged"})) == {"paged": 1, "prefix": 3}
    # while such requests keep arriving the kind keeps that one worker, and no more
    assert p.update(60.0, {"paged": 0.0, "prefix": 500.0}, {"paged": 1, "prefix": 3},
                    needed=frozenset({"paged"})) == {"paged": 1, "prefix": 3}
    # they stopped: the worker goes back
    assert p.update(100.0, {"paged": 0.0, "prefix": 500.0}, {"paged": 1, "prefix": 3}) == {"paged": 0, "prefix": 4}
    assert balanced_split({"paged": 0.0, "prefix": 50.0}, 4, needed=frozenset({"paged"})) == {"paged": 1, "prefix": 3}


def _view(wid: str, kind: str, running: int):
    from gateway.routing.route_types import WorkerView

    return WorkerView(worker_id=wid, model_id="m", engine_kind=kind, version="v1", capabilities=frozenset(),
                      healthy=True, draining=False, num_running=running, num_waiting=0, kv_usage=0.0)


def _decision(kind: str, wanted: str):
    from gateway.routing.route_types import RouteDecision

    return RouteDecision(worker_id="w", engine_kind=kind, variant="default", reason="prefix_held",
                         estimated_reuse=1.0, cached_blocks=20, wanted_kind=wanted)


def test_a_kind_serving_only_the_other_kind_s_demand_is_not_kept_for_it():
    from gateway.control.pool_tracker import PoolTracker
    from gateway.metrics import GatewayMetrics

    t = PoolTracker(GatewayMetrics(), PlannerConfig(window_s=10.0, cooldown_s=0.0))
    # every request wants engine_prefix; some stay on the paged worker that holds their prefix (or spill)
    for now in (0.0, 4.0, 8.0):
        t.meter.record("prefix", now, 2000, 50)
        t.routed(now, _decision("paged", "prefix"))
        t.routed(now, _decision("prefix", "prefix"))
    views = [_view("p", "paged", 2), _view("x", "prefix", 2)]
    assert t.tick(5.0, views) == {"paged": 1, "prefix": 1}  # warming up: held
    # the paged worker is busy, but only with prefix's demand: the planner goes homogeneous
    assert t.tick(11.0, views) == {"paged": 0, "prefix": 2}
    assert t.report(11.0)["needed"] == []


def test_a_request_needing_a_missing_kind_s_capability_brings_a_worker_of_it_back():
    from gateway.control.pool_tracker import PoolTracker
    from gateway.metrics import GatewayMetrics

    t = PoolTracker(GatewayMetrics(), PlannerConfig(window_s=10.0, cooldown_s=30.0))
    t.meter.record("prefix", 0.0, 2000, 50)
    t.meter.record("prefix", 9.0, 2000, 50)
    only_prefix = [_view("x0", "prefix", 1), _view("x1", "prefix", 1)]
    assert t.tick(11.0, only_prefix) == {"paged": 0, "prefix": 2}
    t.capability_demand(12.0, frozenset({"n"}))  # refused with a 503 naming engine_paged
    assert t.tick(12.5, only_prefix) == {"paged": 1, "prefix": 1}
    assert t.report(12.5)["needed"] == ["paged"]


def test_the_observed_prefill_rate_is_the_tokens_each_request_waited_for_over_its_wait():
    from gateway.control.pool_tracker import PoolTracker
    from gateway.metrics import GatewayMetrics

    t = PoolTracker(GatewayMetrics())
    assert t.prefill_rate("w") == 0.0  # nothing measured: routing then has no rate for an external server
    t.prefill_started("r1", "w", 1000, now=10.0)
    t.first_token("r1", now=10.5)
    t.prefill_done("r1")
    assert t.prefill_rate("w") == pytest.approx(1000 / 0.5)  # one wait: no fixed cost to tell apart yet
    t.prefill_started("r2", "w", 1000, now=20.0)
    t.prefill_started("r3", "w", 500, now=20.0)  # queued behind r2: it waits for 1,500 tokens
    t.first_token("r2", now=20.5)
    t.prefill_done("r2")
    t.first_token("r3", now=20.75)
    t.prefill_done("r3")
    # the waits beyond the shortest (0.5 s, the fixed cost of a first token): 0, 0, 0.25 s for 3,500 tokens
    assert t.prefill_rate("w") == pytest.approx((1000 + 1000 + 1500) / 0.25)
    # a failed attempt (no first token) measures nothing, and another worker has a rate of its own
    t.prefill_started("r4", "w", 4000, now=30.0)
    t.prefill_done("r4")
    assert t.prefill_rate("w") == pytest.approx(14000.0) and t.prefill_rate("v") == 0.0
