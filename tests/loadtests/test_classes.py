"""`duet bench classes` and `duet bench compare --pin-cores`: the class workloads, per-class SLOs, the settings
the flags make, worker pinning (real processes on real cores) and one small classes run on real engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from duet.launcher import WorkerSpec, worker_argv
from duet.traffic_classes import GPU, UNCLASSIFIED, ClassBound, bound_of
from loadtests.cli import build_parser
from loadtests.experiments import classes
from loadtests.experiments.classes_cli import classes_settings
from loadtests.experiments.compare import CONFIGS, stack_for
from loadtests.experiments.compare_cli import compare_settings
from loadtests.load.class_slo import CLASS_SLOS, FLEET_SLOS, ClassSlo, parse_class_slos
from loadtests.load.class_workloads import CLASSES, Sizes, class_mix, class_workload, mooncake_think_gaps
from loadtests.load.client import RequestRecord, run_benchmark
from loadtests.load.report import summarize
from loadtests.load.workloads import BenchRequest, TokenSource
from loadtests.sim.fleet.workload import CLASSES as FLEET_CLASSES
from loadtests.stack.pinning import PinError, core_plan
from loadtests.stack.serving import EngineLimits, ServingStack
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir, start_sims

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


@pytest.fixture(scope="module")
def src() -> TokenSource:
    return TokenSource.from_model_dir(model_dir())


@pytest.fixture(scope="module")
def gaps() -> list[float]:
    return mooncake_think_gaps()


def test_each_class_has_the_shape_the_bench_promises(src, gaps):
    docs = class_workload("long_doc", src, 30, sizes=Sizes())
    assert all(1024 <= len(r.prompt_token_ids) <= 4000 and r.depends_on is None for r in docs)
    chat = class_workload("multi_turn", src, 12, think_gaps_s=gaps, think_scale=0.05)
    later = [r for r in chat if r.depends_on]
    assert later and all(r.think_s > 0 for r in later) and all(r.think_s == 0 for r in chat if not r.depends_on)
    scaled = {round(g * 0.05, 9) for g in gaps}
    assert all(round(r.think_s, 9) in scaled for r in later)  # drawn from the trace's own gaps
    tools = class_workload("agent", src, 8)
    heads = {r.prompt_token_ids[:700] for r in tools if r.depends_on is None}
    assert len(heads) == 1  # one shared tool head
    structured = class_workload("structured", src, 4)
    assert all(r.response_format["type"] == "json_schema" for r in structured)
    copy = class_workload("copy_edit", src, 4)
    assert all(r.max_tokens == Sizes().copy_max_tokens and r.response_format is None for r in copy)


def test_the_mix_holds_every_class_and_paged_leaves_out_what_it_cannot_serve(src, gaps):
    mixed = class_mix(src, 20, think_gaps_s=gaps)
    assert {r.traffic_class for r in mixed} == set(CLASSES)
    assert classes.servable("paged") == tuple(c for c in CLASSES if c != "structured")
    paged = classes.build("mixed", src, 20, 0, classes.Settings(), gaps, kind="paged")
    assert "structured" not in {r.traffic_class for r in paged}


def _rec(cls: str, ttft_s: float, prompt_tokens: int = 100, tokens: int = 5, e2e_s: float | None = None):
    e2e = e2e_s if e2e_s is not None else ttft_s + 0.05 * (tokens - 1)
    return RequestRecord("r", cls, None, prompt_tokens, tokens, ttft_s=ttft_s, e2e_s=e2e, output_tokens=tokens,
                         chunk_times_s=[ttft_s])


def test_a_chat_turn_and_a_document_are_judged_by_their_own_bounds():
    slo = ClassSlo()
    assert not slo.met(_rec("multi_turn", 3.0))  # 3 s is too slow for a turn
    assert slo.met(_rec("long_doc", 3.0, prompt_tokens=1024))  # and fine for a document
    assert slo.met(_rec("long_doc", 15.0, prompt_tokens=4000))  # 4 s + 4 ms x 4000 = 20 s
    assert not slo.met(_rec("long_doc", 15.0, prompt_tokens=1024))  # 8.1 s
    assert not slo.met(_rec("agent", 0.5, e2e_s=0.5 + 4 * 0.3))  # TPOT 300 ms > 250
    summary = summarize([_rec("multi_turn", 3.0), _rec("long_doc", 3.0, 1024), _rec("agent", 0.5)], slo)
    assert summary["num_good"] == 2
    assert summary["by_class"]["multi_turn"]["num_good"] == 0 and summary["by_class"]["long_doc"]["num_good"] == 1
    tight = parse_class_slos("long_doc=1000", slo)  # 1 s + 4 ms a token: 5.1 s for 1,024 tokens
    assert not tight.met(_rec("long_doc", 6.0, 1024)) and tight.bound("long_doc").ttft_ms_per_prompt_token == 4.0
    with pytest.raises(ValueError, match="CLASS=TTFT_MS"):
        parse_class_slos("long_doc=fast")


def test_one_definition_in_ms_covers_every_class_of_both_benchmarks():
    """duet/traffic_classes.py is the only place bounds live: every class a workload makes has its own, and the
    overrides read the same way for the class benchmarks and the fleet (ms, or seconds with an s)."""
    assert set(CLASSES) <= set(CLASS_SLOS)
    for cost_model, slo in FLEET_SLOS.items():
        assert set(slo.bounds) == set(FLEET_CLASSES), cost_model
    s = parse_class_slos("agent.tpot=100, long_doc=9s,chat.ttft=1500ms")
    assert (s.bound("agent").ttft_ms, s.bound("agent").itl_ms) == (2000.0, 100.0)
    assert s.bound("long_doc").describe() == {"ttft_ms": 9000.0, "ttft_ms_per_prompt_token": 4.0, "itl_ms": 250.0}
    assert s.bound("chat").ttft_ms == 1500.0 and s.bound("trace_replay") == UNCLASSIFIED
    fleet = parse_class_slos("document.tpot=0.2s", FLEET_SLOS["h200"], FLEET_CLASSES, "--slo")
    assert fleet.bound("document") == ClassBound(bound_of("document", GPU).ttft_ms, 200.0)  # only the TPOT changed
    assert fleet.bound("chat") == bound_of("chat", GPU)
    for bad, message in (("chat=0", "must be > 0"), ("chat.itl=5", "expected CLASS=TTFT_MS"),
                         ("=5", "expected"), ("chat", "expected")):
        with pytest.raises(ValueError, match=message):
            parse_class_slos(bad)
    with pytest.raises(ValueError, match="--slo: 'multi_turn=5': unknown class"):
        parse_class_slos("multi_turn=5", FLEET_SLOS["cpu"], FLEET_CLASSES, "--slo")


def test_pinned_workers_get_taskset_and_one_core_each():
    argv = worker_argv(WorkerSpec("prefix", Path("m"), 5, cpus="1", limits=EngineLimits()))
    assert argv[:3] == ["taskset", "-c", "1"] and argv[3:6] == [sys.executable, "-m", "duet.cli"]
    assert worker_argv(WorkerSpec("paged", Path("m"), 5))[0] == sys.executable
    assert core_plan(2, [0, 1]) == ["0", "1"]
    with pytest.raises(PinError, match="4 workers, but only 2 usable cores"):
        core_plan(4, [0, 1])


@pytest.mark.skipif(not TWO_CORES, reason="pinning needs two cores")
def test_compare_pin_cores_plans_one_worker_per_core_and_per_class_slos():
    s = compare_settings(build_parser().parse_args(["compare", "--pin-cores", "--rates", "medium,heavy",
                                                    "--repeats", "3", "--class-slo", "multi_turn=1500"]))
    assert (s.workers, s.pin_cores, s.rates, s.repeats_at("medium"), s.repeats_at("heavy")) == \
        (2, True, ("medium", "heavy"), 3, 3)
    assert s.class_slo.bound("multi_turn").ttft_ms == 1500 and s.class_slo.bound("long_doc").ttft_ms == 4000
    plans = {name: stack_for(name, model_dir(), s) for name in CONFIGS}
    assert plans["all_paged"].kinds == ["paged", "paged"] and plans["all_prefix"].kinds == ["prefix", "prefix"]
    assert plans["duet_fixed"].kinds == ["paged", "prefix"]
    for stack in plans.values():
        assert sorted(stack.cpus.values()) == core_plan(2)
    plain = compare_settings(build_parser().parse_args(["compare"]))
    assert plain.class_slo is None and not plain.pin_cores and plain.workers == 4
    out = subprocess.run([sys.executable, "-m", "loadtests.cli", "compare", "--pin-cores", "--workers", "64"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "one worker on each core: 64 workers" in out.stderr


def test_classes_flags_make_the_settings():
    p = build_parser()
    s = classes_settings(p.parse_args(["classes", "--kinds", "prefix", "--workloads", "long_doc,mixed",
                                       "--engine-args", "prefix=--cache-eviction lru", "--gateway-cores", "any",
                                       "--rate", "0.5"]))
    assert s.kinds == ("prefix",) and s.workloads == ("long_doc", "mixed") and s.gateway_cores is None
    assert s.engine_args == (("prefix", "--cache-eviction lru"),) and s.rate == 0.5
    with pytest.raises(ValueError, match="KIND=FLAGS"):
        classes_settings(p.parse_args(["classes", "--engine-args", "fast=--x"]))
    with pytest.raises(ValueError, match="unknown kinds or workloads"):
        classes_settings(p.parse_args(["classes", "--workloads", "poetry"]))


def test_a_turn_waits_its_think_time_after_its_parent(tmp_path):
    sims = start_sims([Sim("prefix", ms_per_token=1.0)], tmp_path)
    gw = GatewayThread(gateway_config(sims)).start()
    try:
        first = BenchRequest("s-t0", "multi_turn", tuple(range(10, 60)), 4, session_id="s")
        second = BenchRequest("s-t1", "multi_turn", tuple(range(60, 70)), 4, session_id="s", depends_on="s-t0",
                              think_s=1.5)
        a, b = run_benchmark(gw.url, model_dir().name, [first, second], rate=float("inf"), progress=False)
    finally:
        gw.stop()
        for s in sims:
            s.kill()
    assert a.ok and b.ok
    assert b.start_s >= a.end_s + 1.5


@pytest.mark.skipif(not TWO_CORES, reason="pinning needs two cores")
@pytest.mark.timeout(300)
def test_pinned_stack_runs_each_worker_on_its_own_core(tmp_path):
    with ServingStack(model_dir(), ["paged", "prefix"], {}, EngineLimits(kv_cache_tokens=2048), 240.0, tmp_path,
                      cpus=["0", "1"]) as stack:
        pids = {name: stack.supervisor.pid(name) for name in ("paged-0", "prefix-1")}
        assert os.sched_getaffinity(pids["paged-0"]) == {0}
        assert os.sched_getaffinity(pids["prefix-1"]) == {1}
        assert "gateway" in stack.supervisor.names() and len(os.sched_getaffinity(stack.supervisor.pid("gateway"))) >= 2


@pytest.mark.timeout(600)
def test_a_small_classes_run_reports_every_figure(tmp_path):
    s = classes.Settings(model=str(model_dir()), kinds=("paged", "prefix"), workloads=("structured", "agent"),
                         num_requests=6, calib_requests=3, sizes=classes.QUICK.sizes,
                         limits=EngineLimits(kv_cache_tokens=2048), gateway_cores=None, ready_timeout_s=240)
    result = classes.run(s, tmp_path)
    assert result["runs"]["paged"]["structured"] == {"kind": "paged", "workload": "structured", "unsupported": True}
    for kind, w in (("paged", "agent"), ("prefix", "agent"), ("prefix", "structured")):
        r = result["runs"][kind][w]
        assert r["num_errors"] == 0, r["errors"]
        assert r["capacity_rps"] > 0 and r["rate_arrivals_per_s"] > 0
        row = r["classes"][w]
        assert row["num_requests"] == 6 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["slo"]["ttft_ms"] > 0
    # agent steps resend their history and share the tool head: both engines hit their caches
    assert all(result["runs"][k]["agent"]["classes"]["agent"]["hit_rate"] > 0.3 for k in ("paged", "prefix"))
    assert "| prefix | structured | structured |" in classes.format_table(result)


def test_the_cache_replay_shows_reuse_aware_eviction_keeping_reused_prefixes(src):
    from loadtests.experiments import cache_replay

    result = cache_replay.run(src, 120, kv_budgets=(4096,), page=16, sizes=classes.QUICK.sizes)
    lru, aware = result["by_kv_tokens"]["4096"]["lru"], result["by_kv_tokens"]["4096"]["reuse-aware"]
    assert lru["reused_pages_evicted"] > 0 and aware["reused_pages_evicted"] == 0
    assert aware["hit_rate"]["agent"] > lru["hit_rate"]["agent"]
    assert aware["hit_rate"]["long_doc"] == lru["hit_rate"]["long_doc"] == 0.0  # nothing to reuse either way
    assert cache_replay.run(src, 120, kv_budgets=(4096,), page=16, sizes=classes.QUICK.sizes) == result  # exact


def test_the_cache_replay_runs_at_the_page_size_asked_for(capsys):
    from loadtests.cli import main

    assert main(["classes", "--cache-replay", "--quick", "--num-requests", "40", "--page-size", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["page_size"] == 32 and result["num_requests"] == 40
    assert main(["classes", "--cache-replay", "--quick", "--page-size", "0"]) == 2
    assert "--page-size must be >= 1" in capsys.readouterr().err


# -- real vLLM as one more side (--kinds ...,vllm): everything but vLLM itself, which the vLLM tier covers --------
def test_the_vllm_side_is_asked_for_by_kind_and_configured_by_flag():
    from loadtests.stack.vllm_server import CONFIGS as VLLM_SERVER_CONFIGS

    assert classes.VLLM_CONFIGS == tuple(VLLM_SERVER_CONFIGS)  # the CLI's list, kept without importing vLLM's module
    p = build_parser()
    s = classes_settings(p.parse_args(["classes", "--kinds", "paged,vllm", "--workloads", "mixed", "--vllm-config",
                                       "vllm_bf16", "--engine-args", "vllm=--enforce-eager",
                                       "--engine-args", "paged=--max-decode-step-stretch 3"]))
    assert s.kinds == ("paged", "vllm") and s.vllm_config == "vllm_bf16"
    assert s.engine_args == (("vllm", "--enforce-eager"), ("paged", "--max-decode-step-stretch 3"))
    assert classes_settings(p.parse_args(["classes", "--kinds", "vllm"])).vllm_config == "vllm"  # one core computing
    with pytest.raises(ValueError, match="--vllm-config 'vllm_fast'"):
        classes_settings(p.parse_args(["classes", "--kinds", "vllm", "--vllm-config", "vllm_fast"]))
    with pytest.raises(ValueError, match="unknown kinds or workloads \\['sglang'\\]"):
        classes_settings(p.parse_args(["classes", "--kinds", "paged,sglang"]))


def test_vllm_gets_engine_pageds_mixed_load_request_for_request(src, gaps):
    assert classes.servable("vllm") == classes.servable("paged")
    s = classes.Settings()
    vllm = classes.build("mixed", src, 24, 0, s, gaps, kind="vllm")
    paged = classes.build("mixed", src, 24, 0, s, gaps, kind="paged")
    assert vllm == paged and "structured" not in {r.traffic_class for r in vllm}


def test_vllms_counters_and_kv_budget_in_its_own_units():
    text = ("# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
            'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n')
    assert classes.vllm_preemptions(text) == 5
    with pytest.raises(ValueError, match="no vllm:num_preemptions"):
        classes.vllm_preemptions("vllm:num_requests_running 1.0\n")
    from duet.model_dir import read_model_dir

    c = read_model_dir(model_dir()).config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # fp32 K and V of every layer
    assert classes.vllm_kv_cache_gib(model_dir(), 8192) == 1  # a fraction of a GiB: vLLM's unit is a whole one
    one_gib_and_a_token = 2**30 // per_token + 1
    assert classes.vllm_kv_cache_gib(model_dir(), one_gib_and_a_token) == 2  # rounded up, never below the ask


@pytest.mark.timeout(300)
def test_a_vllm_side_reports_like_a_kind_without_the_counters_it_lacks(tmp_path, monkeypatch):
    """The vllm side's run has every figure a kind's has, its config and cores, and no reused-page evictions;
    a sim behind a gateway stands in for vLLM's server (the vLLM tier runs the real one)."""
    sims = start_sims([Sim("paged", ms_per_token=1.0)], tmp_path)
    gw = GatewayThread(gateway_config(sims)).start()

    class FakeVllm:
        def __init__(self, model, s, log_dir, extra):
            assert extra == ("--enforce-eager",) and s.vllm_config == "vllm"

        def __enter__(self):
            self.url = gw.url
            return self

        def __exit__(self, *exc):
            return None

        def counters(self):
            return {"num_preemptions": 4, "reused_pages_evicted": None}

        def describe(self):
            return {"vllm_config": "vllm", "vllm_reserved_cpus": [1]}

    monkeypatch.setattr(classes, "_VllmSide", FakeVllm)
    s = classes.Settings(model=str(model_dir()), kinds=("vllm",), workloads=("structured", "multi_turn"),
                         num_requests=4, calib_requests=2, sizes=classes.QUICK.sizes,
                         engine_args=(("vllm", "--enforce-eager"),))
    try:
        result = classes.run(s, tmp_path)
    finally:
        gw.stop()
        for sim in sims:
            sim.kill()
    assert result["vllm_config"] == "vllm"
    assert result["runs"]["vllm"]["structured"]["unsupported"]
    r = result["runs"]["vllm"]["multi_turn"]
    assert r["num_errors"] == 0 and r["capacity_rps"] > 0 and r["num_good"] == 4
    assert (r["vllm_config"], r["vllm_reserved_cpus"]) == ("vllm", [1])
    assert (r["num_preemptions"], r["reused_pages_evicted"]) == (0, None)  # after minus before; none reported
    assert r["classes"]["multi_turn"]["tpot_p50_ms"] > 0 and len(r["requests"]) == 4
    assert all(q["class"] == "multi_turn" and q["output_tokens"] > 0 and q["tpot_ms"] for q in r["requests"])
    assert "| vllm | multi_turn | multi_turn |" in classes.format_table(result)
