"""The fleet simulator's model of the gateway path (loadtests/sim/fleet/gateway_path.py) and the worker step trace
that checks the cost model in the running stack (engine_core/step_trace.py, `duet bench fleet --validate`)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from loadtests.sim.fleet.cost_models import LinearCostModel, shape_of, shape_of_counts
from loadtests.sim.fleet.engine import EngineProfile, make_request
from loadtests.sim.fleet.gateway_path import GatewayPath, GatewayQueue
from loadtests.sim.fleet.simulator import FleetSim, SimSettings, StackSpec
from loadtests.sim.fleet.workload import FleetRequest
from loadtests.traces.mooncake import TraceRecord

CPU = EngineProfile.for_cost_model("cpu")
COST = LinearCostModel("cpu", intercept_s=0.07, per_prefill_token_s=0.002, per_decode_token_s=0.0,
                       per_attended_pair_s=1.3e-6, per_row_s=0.003, per_decode_context_token_s=5e-6)
PATH = GatewayPath(request_s=0.004, token_s=0.006)


def _req(i: int, t: float, blocks: tuple[int, ...], tokens: int = 512, session: str | None = None) -> FleetRequest:
    record = TraceRecord(timestamp_ms=int(t * 1000), input_length=tokens, output_length=4, hash_ids=list(blocks))
    return FleetRequest(f"r{i}", t, record, "chat" if session else "document", session, 1, 4, tokens)


def _run(requests, kinds=("prefix",), path=None):
    sim = FleetSim(StackSpec("t", kinds, "duet"), requests, COST, CPU,
                   SimSettings(chain_sessions=False, gateway=path or GatewayPath(), keep_step_log=True))
    return sim, {s.req.request_id: s for s in sim.run()}


def test_a_lone_request_pays_the_gateway_path_on_top_of_its_steps():
    lone = [_req(0, 1.0, (7,))]
    _, bare = _run(lone)
    _, with_path = _run(lone, path=PATH)
    assert bare["r0"].sent_s == with_path["r0"].sent_s == 1.0  # TTFT counts from the client's send
    assert with_path["r0"].ttft_s == pytest.approx(bare["r0"].ttft_s + PATH.request_s + PATH.token_s)
    assert with_path["r0"].tpot_s == pytest.approx(bare["r0"].tpot_s)  # every token is late alike


def test_a_longer_prompt_costs_more_first_token():
    _, short = _run([_req(0, 0.0, (7,), tokens=128)], path=PATH)
    _, long = _run([_req(0, 0.0, (7,), tokens=512)], path=PATH)
    assert long["r0"].ttft_s > short["r0"].ttft_s + 0.5  # 384 more prompt tokens at ~2 ms each


def test_a_burst_reaches_the_worker_one_request_at_a_time():
    """Sent at the same instant: without the gateway all share the first step; through the gateway's one
    loop the first reaches the idle worker alone and runs in a step of its own, the others wait for it
    (what the real stack does: docs/benchmarks.md, the fleet validation)."""
    burst = [_req(i, 0.0, (100 + i,), session=f"s{i}") for i in range(4)]
    sim_bare, bare = _run(burst)
    sim_path, path = _run(burst, path=PATH)
    (w_bare,), (w_path,) = sim_bare.workers.values(), sim_path.workers.values()
    assert [p for p, _, _ in w_bare.step_log[:2]] == [4 * 512, 0]  # the burst's prefills in one step
    assert [p for p, _, _ in w_path.step_log[:2]] == [512, 3 * 512]  # the first alone, then the rest
    assert len({round(s.ttft_s, 9) for s in bare.values()}) == 1
    assert path["r0"].ttft_s < bare["r0"].ttft_s / 2  # it no longer waits for the others' prefill
    assert min(path[f"r{i}"].ttft_s for i in (1, 2, 3)) > bare["r1"].ttft_s  # they wait for its step


def test_the_gateway_queue_is_fifo_at_request_s_each():
    q = GatewayQueue(0.01)
    assert [q.admit(0.0) for _ in range(3)] == pytest.approx([0.01, 0.02, 0.03])
    assert q.admit(1.0) == pytest.approx(1.01)  # idle again: no backlog


def test_routing_sees_the_polled_load_not_the_live_one():
    sim = FleetSim(StackSpec("t", ("paged",), "duet"), [_req(0, 0.0, (7,))], COST, CPU,
                   SimSettings(gateway=GatewayPath(poll_interval_s=0.5)))
    (w,) = sim.workers.values()
    sim.polled = {w.worker_id: w.core.scheduler.load()}  # a poll of the idle worker
    w.core.add(make_request("x", list(range(1, 100)), 4))
    w.core.step()
    assert w.core.scheduler.load().num_running == 1
    assert sim.views()[0].num_running == 0  # until the next poll
    sim.s.gateway = GatewayPath()
    assert sim.views()[0].num_running == 1  # live


@pytest.mark.parametrize("kwargs, message", [({"request_s": -1.0}, ">= 0"), ({"poll_interval_s": 0.0}, "> 0")])
def test_bad_gateway_paths_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatewayPath(**kwargs)


def test_a_fit_without_a_gateway_section_says_how_to_measure_it(tmp_path):
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"coefficients": {}}))
    with pytest.raises(ValueError, match="fleet-calibrate --gateway"):
        GatewayPath.from_json(0.5, fit)
    fit.write_text(json.dumps({"gateway": {"request_s": 0.003, "token_s": 0.005}}))
    assert GatewayPath.from_json(0.5, fit) == GatewayPath(0.003, 0.005, 0.5)


def test_the_shipped_fit_has_a_measured_gateway_path():
    path = GatewayPath.from_json(0.5)
    assert 0 < path.request_s < 0.5 and 0 < path.token_s < 0.5


def test_the_step_trace_records_what_the_real_step_loop_ran(tmp_path, monkeypatch):
    """A real StepLoop (the real paged scheduler, the simulator's cost runner as its model) with
    DUET_STEP_TRACE on: one line per step, its chunks the shape the cost model reads."""
    from engine_core.step_loop import StepLoop
    from engine_core.step_trace import STEP_TRACE_ENV, read_traces
    from loadtests.sim.fleet.engine import CostRunner, build_scheduler

    monkeypatch.setenv(STEP_TRACE_ENV, str(tmp_path))
    shapes = []

    class Recording(CostRunner):
        def forward(self, chunks):
            shapes.append(shape_of(chunks))
            return super().forward(chunks)

    async def serve():
        loop = StepLoop(build_scheduler("paged", CPU), Recording(COST))
        loop.start()
        try:
            return [o async for o in loop.generate(make_request("a", list(range(1, 41)), 3))]
        finally:
            loop.stop()

    outs = asyncio.run(serve())
    assert sum(len(o.token_ids) for o in outs) == 3
    (steps,) = read_traces(tmp_path).values()
    assert len(steps) == len(shapes) == 3
    assert steps[0]["chunks"] == [[40, 0, 1]]  # the prompt's prefill, one logits row
    assert [shape_of_counts(s["chunks"]) for s in steps] == shapes
    assert all(s["step_s"] >= s["forward_s"] >= 0 for s in steps)


def test_validate_compares_traced_steps_with_the_model(tmp_path):
    """Worker 42's steps took twice the model; its first two ran while worker 43 was mid-step, the third alone."""
    from loadtests.sim.fleet.step_check import step_cost_check

    model = LinearCostModel.from_json()
    chunks = [[512, 0, 1]]
    seconds = model.step_seconds(shape_of_counts(chunks))
    lines = [{"t": 10.0 * i, "step_s": 2 * seconds + 0.001, "forward_s": 2 * seconds, "chunks": chunks}
             for i in range(3)]
    (tmp_path / "steps-42.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # the neighbour's steps start with 42's and last 1.5 times as long: 42 is mid-step for two thirds of each,
    # whatever the shipped fit's seconds are
    long = 1.5 * (2 * seconds + 0.001)
    neighbour = [{"t": 10.0 * i, "step_s": long, "forward_s": long, "chunks": [[1, 100, 1]]} for i in range(2)]
    (tmp_path / "steps-43.jsonl").write_text("".join(json.dumps(x) + "\n" for x in neighbour))
    result = step_cost_check(tmp_path, {42: "paged-0", 43: "prefix-1"})
    paged = result["paged-0"]
    assert paged["prefill"] == {"steps": 1, "forward_over_model_sum": 2.0, "forward_over_model_median": 2.0}
    assert paged["prefill_with_neighbour_busy"]["steps"] == 2
    assert paged["outside_forward_s_per_step"] == pytest.approx(0.001)
    assert "decode" not in paged
    assert result["prefix-1"]["decode_with_neighbour_busy"]["steps"] == 2  # worker 42 was mid-step throughout


def test_validate_reads_window_and_rate_only_when_given():
    from loadtests.sim.fleet.cli import validate_settings
    from loadtests.sim.fleet.validate import ValidateSettings

    assert validate_settings(argparse.Namespace(window_s=None, rate=None)) == ValidateSettings()
    assert validate_settings(argparse.Namespace(window_s=20.0, rate=None)).window_s == 20.0
    with pytest.raises(ValueError, match="must be > 0"):
        validate_settings(argparse.Namespace(window_s=-1.0, rate=None))


def test_validate_simulates_through_the_measured_gateway_path():
    from loadtests.sim.fleet.validate import ValidateSettings, simulated
    from loadtests.sim.fleet.workload import MIXES, build

    s = ValidateSettings(window_s=12.0)
    requests = build(MIXES["mixed"], s.window_s, s.rate, CPU.max_model_len, max_output_tokens=s.max_output_tokens,
                     max_prompt_tokens=s.max_prompt_tokens)
    figures = simulated(requests, s)
    path = GatewayPath.from_json(0.5)
    assert figures["completed"] == figures["requests"] == len(requests)
    assert set(figures["ttft_p50_s_by_class"]) == {"chat", "document"}
    assert min(figures["ttft_p50_s_by_class"].values()) > path.request_s + path.token_s


def test_per_request_rows_pair_both_sides_by_id():
    from loadtests.load.client import RequestRecord
    from loadtests.sim.fleet.validate import ValidateSettings, per_request_rows, simulated_served
    from loadtests.sim.fleet.workload import MIXES, build

    s = ValidateSettings(window_s=4.0)
    requests = build(MIXES["mixed"], s.window_s, s.rate, CPU.max_model_len, max_output_tokens=s.max_output_tokens,
                     max_prompt_tokens=s.max_prompt_tokens)
    served = simulated_served(requests, s)
    first = requests[0]
    records = [RequestRecord(first.request_id, first.traffic_class, first.session, 512, 32, ttft_s=1.5, e2e_s=2.0,
                             output_tokens=3, engine="paged", route_reason="reuse_low")]
    rows = per_request_rows(served, records)
    assert [r["request_id"] for r in rows] == [r.request_id for r in requests]
    assert rows[0]["local"]["ttft_s"] == 1.5 and rows[0]["local"]["tpot_s"] == 0.25
    assert rows[0]["sim"]["ttft_s"] > 0 and all(r["local"] is None for r in rows[1:])
    json.dumps(rows)  # a JSON line each


def test_a_step_is_slower_while_the_other_worker_is_mid_step():
    """Two workers, one document each at the same instant: the second worker's step starts while the first's
    is running and takes `neighbour_slowdown` longer (the first started alone: a first-order model, applied at
    a step's start); a worker alone on the machine is never slowed."""
    docs = [_req(0, 0.0, (7,)), _req(1, 0.0, (8,))]
    lone = [_req(0, 0.0, (7,))]

    def ttfts(requests, slowdown):
        sim = FleetSim(StackSpec("t", ("paged", "paged"), "duet"), requests, COST, CPU,
                       SimSettings(chain_sessions=False, neighbour_slowdown=slowdown))
        return {s.req.request_id: s.ttft_s for s in sim.run()}

    base, slowed = ttfts(docs, 0.0), ttfts(docs, 0.1)
    assert slowed["r0"] == pytest.approx(base["r0"])
    assert slowed["r1"] == pytest.approx(base["r1"] * 1.1)
    assert ttfts(lone, 0.1) == pytest.approx(ttfts(lone, 0.0))  # alone on the machine: no slowdown


def test_the_shipped_fit_has_a_measured_neighbour_slowdown():
    from loadtests.sim.fleet.cost_models import CPU_FIT

    assert 0 <= json.loads(CPU_FIT.read_text())["neighbour_slowdown"] < 1

