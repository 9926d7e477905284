"""Both simulators route through the gateway's own Router (gateway/serving/router.py): its decide and its
record, once per request, so that the simulated routing cannot drift from the gateway's."""

from __future__ import annotations

import pytest

from gateway.serving.router import Router
from loadtests.sim.fleet.cost_models import RooflineCostModel
from loadtests.sim.fleet.engine import EngineProfile
from loadtests.sim.fleet.simulator import FleetSim, SimSettings, StackSpec
from loadtests.sim.fleet.workload import build
from loadtests.sim.routing.simulate import make_policy, simulate
from loadtests.traces import shipped
from loadtests.traces.mooncake import load_trace

SMALL = EngineProfile(kv_cache_tokens=12_288, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=4096)


@pytest.fixture
def router_calls(monkeypatch) -> dict[str, list]:
    """Counts the Router's decide and record calls, then runs the real ones."""
    calls: dict[str, list] = {"decide": [], "record": []}
    decide, record = Router.decide, Router.record

    def counted_decide(self, req, *args, **kwargs):
        calls["decide"].append(req.sequence)
        return decide(self, req, *args, **kwargs)

    def counted_record(self, request_id, req, decision):
        calls["record"].append(request_id)
        return record(self, request_id, req, decision)

    monkeypatch.setattr(Router, "decide", counted_decide)
    monkeypatch.setattr(Router, "record", counted_record)
    return calls


@pytest.mark.parametrize("policy", ["duet", "sglang"])
def test_the_fleet_simulator_routes_every_request_through_the_gateways_router(router_calls, policy):
    requests = build({"mooncake": 1.0, "azure_code": 1.0}, window_s=4.0, rate=2.0, max_model_len=SMALL.max_model_len,
                     max_output_tokens=8, max_prompt_tokens=2048)
    sim = FleetSim(StackSpec("mixed", ("paged", "prefix"), policy), requests, RooflineCostModel(), SMALL,
                   SimSettings(chain_sessions=False))
    served = sim.run()
    assert len(served) == len(requests) > 0
    assert len(router_calls["decide"]) == len(requests)
    assert sorted(router_calls["record"]) == sorted(r.request_id for r in requests)


def test_the_routing_simulation_routes_every_request_through_the_gateways_router(router_calls):
    records = load_trace(shipped.path_of("mooncake", shipped.SHIPPED_DIR))[:200]
    result = simulate(records, make_policy("duet", 4, 4096), 4, 4096)
    assert sum(result["reasons"].values()) == len(records)
    assert router_calls["decide"] == list(range(len(records)))
    assert len(router_calls["record"]) == len(set(router_calls["record"])) == len(records)
