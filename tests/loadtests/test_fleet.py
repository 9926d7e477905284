"""`duet bench fleet`: the simulator's step accounting is the real schedulers' (exactly), its clock is the sum
of modelled step costs, the planner may go to zero workers of a kind, the JSON is complete and sane, and bad
arguments are clear errors."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from duet.traffic_classes import GPU, bound_of
from gateway.control.pool_planner import PlannerConfig
from loadtests.cli import main
from loadtests.sim.fleet.cost_models import LinearCostModel, RooflineCostModel, StepShape, shape_of
from loadtests.sim.fleet.engine import EngineProfile, SimEngine, make_request
from loadtests.sim.fleet.simulator import FleetSim, SimSettings, StackSpec
from loadtests.sim.fleet.workload import build

# small enough to preempt: 40 requests of up to 2k tokens on 4k tokens of KV (engine_paged caps the prefill it
# adds beside decodes, so with 12k it no longer runs short)
SMALL = EngineProfile(kv_cache_tokens=4_096, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=4096)


def _workload():
    return build({"mooncake": 1.0, "azure_code": 1.0}, window_s=8.0, rate=2.0, max_model_len=SMALL.max_model_len,
                 max_output_tokens=24, max_prompt_tokens=2048)


def _direct(kind: str, requests, cost):
    """The same requests into one real EngineCore + scheduler, stepped by hand: arrivals up to the clock
    are added (stamped with their arrival time, as the simulator stamps them), then one step; an idle engine
    jumps to the next arrival. The scheduler reads the same virtual clock (engine_prefix's aging)."""
    clock = {"t": 0.0}
    w = SimEngine.build("w", kind, SMALL, cost, keep_log=True, clock=lambda: clock["t"])
    pending = list(requests)
    costs, done = [], {}
    while pending or w.core.has_unfinished():
        while pending and pending[0].arrival_s <= clock["t"]:
            r = pending.pop(0)
            w.core.add(make_request(r.request_id, r.prompt(SMALL.max_model_len), r.max_tokens, r.arrival_s))
        if not w.core.has_unfinished():
            clock["t"] = pending[0].arrival_s
            continue
        result, seconds = w.step()
        clock["t"] += seconds
        costs.append(seconds)
        for out in result.outputs:
            if out.cached_tokens is not None:
                done.setdefault(out.request_id, {})["cached"] = out.cached_tokens
            if out.finish_reason is not None:
                done.setdefault(out.request_id, {})["end"] = clock["t"]
    return w, costs, done


@pytest.mark.parametrize("kind", ["paged", "prefix"])
def test_step_accounting_is_the_real_schedulers(kind):
    requests = _workload()
    cost = RooflineCostModel()
    direct, costs, done = _direct(kind, requests, cost)
    sim = FleetSim(StackSpec(kind, (kind,), "sglang"), requests, cost, SMALL,
                   SimSettings(keep_step_log=True, chain_sessions=False))
    served = sim.run()
    (engine,) = sim.workers.values()
    assert engine.step_log == direct.step_log  # (prefill tokens, decode tokens, preemptions so far) per step
    if kind == "paged":  # the KV budget is small enough that it preempts (engine_prefix reserves decode room first)
        assert direct.step_log[-1][2] > 0
    assert sum(p for p, _, _ in direct.step_log) > 0 and sum(d for _, d, _ in direct.step_log) > 0
    assert {s.req.request_id: s.cached_tokens for s in served} == {k: v["cached"] for k, v in done.items()}
    assert sum(s.cached_tokens for s in served) > 0  # the shared system prompt is a cache hit
    assert {s.req.request_id: s.last_s for s in served} == pytest.approx({k: v["end"] for k, v in done.items()})
    # the cost runner's clock is the sum of the modelled step costs
    assert engine.runner.clock == pytest.approx(math.fsum(costs))
    assert all(s.done and s.tokens == s.req.max_tokens for s in served)


def test_step_shape_and_cost_models():
    from engine_core.forward_batch import SeqChunk

    shape = shape_of([SeqChunk([1] * 4, 10, [0]), SeqChunk([1], 7, [1])])
    assert shape == StepShape(prefill_tokens=4, decode_tokens=1, context_tokens=22, attended_pairs=4 * 10 + 10 + 8,
                              rows=2, decode_context_tokens=8)
    h200 = RooflineCostModel()
    decode = h200.step_seconds(StepShape(0, 32, 32 * 4097, 32 * 4097, 32, 32 * 4097))
    assert decode == pytest.approx(0.0097, abs=2e-4)  # the module docstring's figures
    prefill = h200.step_seconds(StepShape(8192, 0, 8192, 8192 * 8193 // 2, 1))
    assert prefill == pytest.approx(0.24, abs=0.01)
    cpu = LinearCostModel.from_json()
    assert cpu.step_seconds(StepShape(512, 0, 512, 512 * 513 // 2, 1)) > cpu.step_seconds(StepShape(0, 1, 512, 512, 1))


def test_the_70b_model_is_costlier_per_token_and_leaves_a_fifth_of_the_kv():
    from loadtests.sim.fleet.cost_models import cost_model

    big, small = cost_model("h200-70b"), cost_model("h200")
    prefill = StepShape(8192, 0, 8192, 8192 * 8193 // 2, 1)
    decode = StepShape(0, 64, 64 * 4097, 64 * 4097, 64, 64 * 4097)
    assert big.step_seconds(prefill) == pytest.approx(1.11, abs=0.02)  # the FLOPs of 68.5e9 parameters at 0.55 of FP8
    assert 4 < big.step_seconds(prefill) / small.step_seconds(prefill) < 5
    assert big.step_seconds(decode) > 2.5 * small.step_seconds(decode)
    assert EngineProfile.for_cost_model("h200-70b").kv_cache_tokens * 4 < EngineProfile.for_cost_model("h200").kv_cache_tokens
    code, out, _ = _cli("fleet", "--cost-model", "h200-70b", "--workers", "2", "--window-s", "4", "--rate", "1",
                        "--max-output-tokens", "8", "--stacks", "all_prefix", "--json")
    assert code == 0 and json.loads(out)["stacks"]["all_prefix"]["completed"] > 0


def test_the_planner_may_choose_zero_of_a_kind():
    """One-shot documents only: routing wants engine_paged for all of them, so the planner gives every
    prefix worker up (one switch at a time) and the fleet ends homogeneous."""
    requests = build({"azure_code": 1.0}, window_s=60.0, rate=4.0, max_model_len=4096, max_output_tokens=8)
    settings = SimSettings(planner=PlannerConfig(window_s=3.0, cooldown_s=1.0), switch_s=0.5)
    sim = FleetSim(StackSpec("duet_planner", ("paged", "prefix", "prefix"), "duet", planner=True), requests,
                   RooflineCostModel(), EngineProfile.for_cost_model("h200"), settings)
    served = sim.run()
    assert all(s.done for s in served) and len(served) == len(requests)
    assert sorted(w.kind for w in sim.workers.values()) == ["paged"] * 3
    assert sim.switches == 2


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_json_has_every_stack_and_sane_figures():
    code, out, _ = _cli("fleet", "--workers", "2", "--window-s", "6", "--rate", "2", "--max-output-tokens", "16",
                        "--split", "1:1", "--slo", "chat.ttft=30000,document.ttft=30s", "--json")
    assert code == 0
    result = json.loads(out)
    stacks = result["stacks"]
    assert set(stacks) == {"all_paged", "all_prefix", "duet_planner", "duet_1:1"}
    best_homogeneous = max(stacks["all_paged"]["goodput_rps"], stacks["all_prefix"]["goodput_rps"])
    for name, r in stacks.items():
        assert 0 <= r["slo_attainment"] <= 1, name
        assert r["completed"] == r["requests"] > 0
        for cls in ("chat", "document"):
            c = r["classes"][cls]
            assert c["ttft_p50_s"] <= c["ttft_p99_s"] and c["tpot_p50_s"] <= c["tpot_p99_s"]
            assert c["slo"]["ttft_ms"] == 30000.0 and c["slo"]["itl_ms"] == bound_of(cls, GPU).itl_ms  # TPOT kept
        assert r["goodput_ratio_vs_best_homogeneous"] == round(r["goodput_rps"] / best_homogeneous, 4), name
    assert max(stacks["all_paged"]["goodput_ratio_vs_best_homogeneous"],
               stacks["all_prefix"]["goodput_ratio_vs_best_homogeneous"]) == 1.0
    assert stacks["all_paged"]["classes"]["chat"]["served_by"] == {"paged": stacks["all_paged"]["classes"]["chat"]["requests"]}


@pytest.mark.parametrize("args, message", [
    (("--workers", "4", "--split", "3:3"), "add up to --workers 4"),
    (("--split", "16"), "expected PAGED:PREFIX"),
    (("--cost-model", "tpu"), "--cost-model must be one of cpu, h200, h200-70b, got 'tpu'"),
    (("--slo", "chat.latency=2"), "--slo: 'chat.latency=2': expected CLASS=TTFT_MS"),
    (("--slo", "long_doc.ttft=2"), "unknown class 'long_doc' (classes: chat, document)"),
    (("--slo", "chat.ttft=-1"), "must be > 0"),
    (("--trace", "nosuch=1"), "unknown source 'nosuch'"),
    (("--stacks", "all_gpu"), "unknown all_gpu"),
    (("--rate", "0"), "must be > 0"),
])
def test_bad_arguments_are_clear_errors(args, message):
    code, _, err = _cli("fleet", "--window-s", "1", *args)
    assert code == 2
    assert message in err


def _option(paged, prefix, goodput, p99=1.0):
    return {"workers": {"paged": paged, "prefix": prefix}, "goodput_rps": goodput, "ttft_p99_s": p99}


def test_advise_recommends_a_split_only_past_the_margin():
    from loadtests.advise.fleet import default_splits
    from loadtests.advise.rule import recommend

    assert default_splits(32) == ((8, 24), (16, 16), (24, 8))
    assert default_splits(2) == ((1, 1),)
    options = {"all_paged": _option(4, 0, 1.0), "all_prefix": _option(0, 4, 2.0), "duet_2:2": _option(2, 2, 2.05)}
    rec = recommend(options)
    assert (rec["deployment"], rec["split"]) == ("all_prefix", {"paged": 0, "prefix": 4})  # 1.025x: within the margin
    assert rec["router"] == "sglang-style"
    options["duet_2:2"] = _option(2, 2, 3.0)
    rec = recommend(options)
    assert rec["deployment"] == "duet_2:2" and rec["goodput_ratio_vs_best_homogeneous"] == 1.5


def test_advise_credits_a_gain_to_the_router_when_one_kind_behind_it_does_as_well():
    from loadtests.advise.rule import recommend

    # the split beats the SGLang-style fleets by 1.5x, but all-prefix behind Duet's router serves 2.9 of its 3.0
    options = {"all_paged": _option(4, 0, 1.0), "all_prefix": _option(0, 4, 2.0), "duet_2:2": _option(2, 2, 3.0),
               "paged_duet_routing": _option(4, 0, 1.2), "prefix_duet_routing": _option(0, 4, 2.9)}
    rec = recommend(options)
    assert (rec["deployment"], rec["router"], rec["split"]) == ("prefix_duet_routing", "duet", {"paged": 0, "prefix": 4})
    assert rec["split_ratio_vs_best_one_kind"] == round(3.0 / 2.9, 3) and "routing's" in rec["why"]
    # past the margin over every one-kind fleet, the pairing is what pays
    options["duet_2:2"] = _option(2, 2, 3.5)
    assert recommend(options)["deployment"] == "duet_2:2"
    # Duet's router gaining nothing over the SGLang-style one: the plain homogeneous fleet
    options = {"all_paged": _option(4, 0, 1.0), "all_prefix": _option(0, 4, 2.0), "duet_2:2": _option(2, 2, 2.02),
               "paged_duet_routing": _option(4, 0, 1.0), "prefix_duet_routing": _option(0, 4, 2.05)}
    assert recommend(options)["deployment"] == "all_prefix"


def test_advise_fleet_gives_every_option_cost_and_sensitivity():
    from loadtests.advise.fleet import recommend

    code, out, _ = _cli("advise", "--fleet", "--trace", "mixed", "--workers", "2", "--window-s", "2",
                        "--class-slo", "chat.ttft=30000,document.ttft=30000", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result["sensitivity"]) == {"traffic", "half_traffic", "double_traffic"}
    options = result["rates"]["traffic"]["options"]
    assert set(options) == {"all_paged", "all_prefix", "paged_duet_routing", "prefix_duet_routing", "duet_1:1"}
    for o in options.values():
        assert o["usd_per_million_tokens"] > 0 and o["goodput_rps"] > 0
    # the advice is the published rule applied to the options printed beside it, at every traffic level
    assert result["recommendation"] == recommend(options)
    assert result["sensitivity"] == {label: recommend(r["options"])["deployment"]
                                     for label, r in result["rates"].items()}
