"""The SGLang-style cache-aware baseline behind the gateway (loadtests/routing_baselines.py): the policy
`duet bench compare` and `advise` run in place of Duet's, the same one `simulate-routing` replays."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from gateway.config import ConfigError, from_dict
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from loadtests.experiments.routing_baselines import (
    SGLANG_REASONS,
    SGLANG_ROUTING_POLICY,
    CacheAwareTrees,
    SGLangCacheAware,
    SGLangRoute,
)
from loadtests.experiments.simulate_routing import SimWorker
from loadtests.traces.mooncake import TraceRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import GatewayThread, Sim, gateway_config, model_dir, start_sims

CAPS = {"paged": frozenset({"n", "beam_search"}), "prefix": frozenset({"structured_output", "speculative"})}


def worker(wid: str, kind: str = "prefix", running: int = 0) -> WorkerView:
    return WorkerView(worker_id=wid, model_id="m", engine_kind=kind, version="v1", capabilities=CAPS[kind],
                      healthy=True, draining=False, num_running=running, num_waiting=0, kv_usage=0.1)


def req(hashes, **kw) -> RouteRequest:
    return RouteRequest(model="m", block_hashes=tuple(hashes), num_prompt_tokens=16 * len(hashes) + 5, **kw)


class Gateway:
    """The SGLang policy called as the gateway calls gateway.routing.policy.route."""

    def __init__(self) -> None:
        self.policy = SGLangRoute()
        self.seen, self.index = SeenBlocks(), WorkerBlockIndex()

    def __call__(self, r: RouteRequest, workers, affinity=None):
        d = self.policy(r, workers, RoutingConfig(), affinity, self.seen, self.index)
        assert d.reason in SGLANG_REASONS or d.reason in ("capability", "override")
        return d


MIXED = [worker("p0", "paged"), worker("p1", "paged"), worker("x0", "prefix"), worker("x1", "prefix")]


def test_the_worker_a_prompt_went_to_gets_its_next_turn_whatever_affinity_or_engine_kind_say():
    g = Gateway()
    g(req([5, 6]), [worker("p1", "paged")])  # p1's tree now holds the prompt
    d = g(req([5, 6, 7], session_key="s", turn_count=3), MIXED, affinity="x1")
    assert (d.worker_id, d.reason) == ("p1", "cache_match")  # duet would keep x1 (affinity)


def test_a_low_match_rate_goes_to_the_smallest_tree():
    g = Gateway()
    g(req([1, 2, 3, 4]), [worker("a")])
    g(req([9]), [worker("b")])
    # 1 of 10 blocks matches on a: below cache_threshold 0.3, so the worker that holds less takes it
    d = g(req([1] + list(range(20, 29))), [worker("a"), worker("b"), worker("c")])
    assert (d.worker_id, d.reason) == ("c", "smallest_tree")


def test_the_imbalance_guard_overrides_the_cache_match():
    g = Gateway()
    g(req(range(1, 101)), [worker("hot")])
    d = g(req(range(1, 101)), [worker("hot", running=100), worker("cold", running=2)])
    assert (d.worker_id, d.reason) == ("cold", "imbalance")  # 98 > 64 and 100 > 1.5 x 2
    # a gap under balance_abs_threshold is not imbalance: the cache wins again
    d = g(req(range(1, 101)), [worker("hot", running=60), worker("cold", running=2)])
    assert (d.worker_id, d.reason) == ("hot", "cache_match")


def test_the_gateway_s_capability_step_still_applies():
    d = Gateway()(req([1], required_capabilities=frozenset({"structured_output"})), MIXED)
    assert d.engine_kind == "prefix" and d.reason == "capability"


def test_the_simulator_and_the_gateway_make_the_same_choice():
    # one CacheAwareTrees behind both: the same prompts and loads give the same workers
    sim, trees = SGLangCacheAware(3), CacheAwareTrees(512)
    workers = [SimWorker(f"w{i}", None) for i in range(3)]
    for k, hashes in enumerate([(1, 2), (1, 2, 3), (7,), (1, 2, 3, 4), (7, 8)]):
        rec = TraceRecord(timestamp_ms=k, input_length=512 * len(hashes), output_length=1, hash_ids=hashes)
        i = sim.choose(rec, workers)
        j, _ = trees.choose(["w0", "w1", "w2"], [0, 0, 0], hashes, rec.input_length)
        assert i == j
        sim.observe(i, rec, [], workers)
        trees.observe(f"w{j}", hashes)


def test_the_gateway_config_names_the_policy_and_refuses_what_names_nothing(tmp_path):
    assert from_dict({"routing_policy": SGLANG_ROUTING_POLICY}).routing_policy == SGLANG_ROUTING_POLICY
    with pytest.raises(ConfigError, match="routing_policy"):
        from_dict({"routing_policy": "loadtests.experiments.routing_baselines:no_such_policy"})
    # the gateway's own routing config has no benchmark policies
    with pytest.raises(ConfigError, match="unknown keys"):
        from_dict({"routing": {"policy": "cache_aware"}})


@pytest.mark.timeout(120)
def test_a_gateway_whose_config_names_the_baseline_routes_by_it(tmp_path):
    sims = start_sims([Sim("prefix", worker_id="a"), Sim("prefix", worker_id="b")], tmp_path)
    gw = GatewayThread(gateway_config(sims, routing_policy=SGLANG_ROUTING_POLICY)).start()
    try:
        prompt = "the same long document, " * 40
        got = []
        for session in ("one", "two"):  # two sessions: Duet's affinity has nothing to keep
            r = httpx.post(gw.url + "/v1/completions", headers={"x-session-id": session}, timeout=30,
                           json={"model": model_dir().name, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            got.append((r.headers["x-duet-worker"], r.headers["x-duet-route-reason"]))
        # nothing sent yet: the smallest tree; then the worker the prompt went to, by SGLang's cache match
        assert got[0][1] == "smallest_tree" and got[1] == (got[0][0], "cache_match")
    finally:
        gw.stop()
        for s in sims:
            s.kill()
