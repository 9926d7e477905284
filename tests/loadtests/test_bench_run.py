"""`duet bench run`: the streaming client against a live gateway (sim workers, and once real engines),
the summary, the plots, the command line. The Mooncake replayer's reuse structure is tested in
test_simulate_routing.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from duet.tokenizer import Tokenizer
from loadtests.cli import main as bench_main
from loadtests.load.client import run_benchmark
from loadtests.load.report import BREAKDOWNS, LATENCIES, Slo, format_markdown, summarize, write_plots
from loadtests.load.trace_workloads import mooncake
from loadtests.load.workloads import BenchRequest, TokenSource, agent, build_workload, multi_turn
from loadtests.traces import shipped
from tests.support.stack import ROOT, GatewayThread, Sim, gateway_config, model_dir, start_sims

MODEL = model_dir().name


@pytest.fixture(scope="module")
def src() -> TokenSource:
    return TokenSource.from_model_dir(model_dir())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(model_dir())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    sims = start_sims([Sim("prefix", ms_per_token=1.0), Sim("paged", ms_per_token=1.0)], tmp)
    gw = GatewayThread(gateway_config(sims)).start()
    yield gw
    gw.stop()
    for s in sims:
        s.kill()


@pytest.fixture(scope="module")
def mix_records(stack, src, tokenizer):
    requests = build_workload("mix", src, 24, 512, 8, seed=3)
    return requests, run_benchmark(stack.url, MODEL, requests, concurrency=4, encode=tokenizer.encode,
                                   keep_prompts=True, progress=False)


def test_every_request_streams_its_tokens_and_duet_headers(mix_records):
    requests, records = mix_records
    assert [r.request_id for r in records] == [r.request_id for r in requests]
    for req, rec in zip(requests, records):
        assert rec.ok, rec.error
        assert rec.output_tokens == req.max_tokens  # ignore_eos: exact lengths
        assert 0 < rec.ttft_s <= rec.e2e_s
        assert rec.engine in ("paged", "prefix") and rec.variant == "default" and rec.route_reason
        assert rec.tpot_s > 0 and len(rec.itl_s) == len(rec.chunk_times_s) - 1
    assert {r.traffic_class for r in records} == {"chat", "multi_turn", "agent", "long_doc"}


def test_a_turn_resends_the_history_and_the_answer_after_the_previous_turn(mix_records, tokenizer):
    requests, records = mix_records
    by_id = {r.request_id: r for r in records}
    dependent = [r for r in requests if r.depends_on]
    assert len(dependent) >= 5
    for req in dependent:
        rec, parent = by_id[req.request_id], by_id[req.depends_on]
        answer = tuple(tokenizer.encode(parent.output_text))[: parent.max_tokens]
        assert answer  # the model said something, and it is resent
        assert rec.prompt_token_ids == parent.prompt_token_ids + answer + req.prompt_token_ids
        assert rec.start_s >= parent.end_s
        assert rec.session_id == parent.session_id


def test_summary_fields_are_present_and_consistent(mix_records):
    _, records = mix_records
    s = summarize(records, Slo(ttft_ms=10_000, itl_ms=10_000))
    groups = [s] + [g for key in BREAKDOWNS for g in s[key].values()]
    for g in groups:
        assert g["num_ok"] + g["num_errors"] == g["num_requests"]
        assert g["num_good"] <= g["num_ok"]
        assert 0 <= g["goodput_rps"] <= g["request_throughput_rps"]
        assert g["output_token_throughput_tps"] > 0 and g["input_token_throughput_tps"] > 0
        for lat in LATENCIES:
            st = g[lat]
            assert 0 < st["p50"] <= st["p90"] <= st["p99"], (lat, st)
        assert g["ttft_ms"]["p50"] <= g["e2e_ms"]["p99"]
    assert s["num_good"] == s["num_ok"] == 24  # generous SLOs: all good
    for key in BREAKDOWNS:  # every breakdown covers every request (all went through Duet)
        assert sum(g["num_requests"] for g in s[key].values()) == 24
        total = sum(g["request_throughput_rps"] for g in s[key].values())
        assert total == pytest.approx(s["request_throughput_rps"])
    assert set(s["by_engine"]) <= {"paged", "prefix"}
    strict = summarize(records, Slo(ttft_ms=0.001))
    assert strict["num_good"] == 0 and strict["goodput_rps"] == 0
    table = format_markdown(s)
    assert "| all | 24 |" in table and "class=long_doc" in table and "engine=" in table


def test_plots_are_png_files(mix_records, tmp_path):
    _, records = mix_records
    for path in write_plots(records, tmp_path):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, path


def test_open_loop_sends_at_the_arrival_times(stack, src):
    reqs = [BenchRequest(f"r{i}", "chat", tuple(src.draw(f"r{i}", 32)), 2, arrival_s=0.25 * i) for i in range(3)]
    records = run_benchmark(stack.url, MODEL, reqs, progress=False)
    assert all(r.ok for r in records)
    for i, r in enumerate(records):
        assert 0.25 * i <= r.start_s < 0.25 * i + 0.2
    with pytest.raises(ValueError, match="--rate R or --concurrency C"):
        run_benchmark(stack.url, MODEL, [BenchRequest("x", "chat", (5, 6), 2)], progress=False)


def test_errors_are_recorded_per_request_and_dependents_are_not_sent(stack, src):
    requests = multi_turn(src, 2, 256, 4)
    records = run_benchmark(stack.url, "no-such-model", requests, concurrency=2, progress=False)
    assert records[0].error.startswith("HTTP 404") and "no-such-model" in records[0].error
    assert records[1].error == "previous turn failed"
    s = summarize(records)
    assert s["num_errors"] == 2 and s["ttft_ms"]["p50"] is None and s["errors"]


def test_a_trace_workload_without_trace_replays_the_shipped_trace_of_its_name(src):
    default = build_workload("mooncake", src, 5, 700, 16)
    assert [r.prompt_token_ids for r in default] == [r.prompt_token_ids for r in
                                                      mooncake(shipped.path_of("mooncake"), src, 5, 700, 16)]


def test_trace_replay_caps_lengths_and_scales_time(src):
    trace = shipped.path_of("mooncake")
    reqs = mooncake(trace, src, 50, 700, 16, time_scale=0.5)
    assert max(len(r.prompt_token_ids) for r in reqs) == 700 and max(r.max_tokens for r in reqs) == 16
    full = mooncake(trace, src, 50, 10**6, 16)
    assert all(r.arrival_s == pytest.approx(f.arrival_s * 0.5) for r, f in zip(reqs, full))
    assert all(f.prompt_token_ids[:700] == r.prompt_token_ids for r, f in zip(reqs, full))
    specials = set(Tokenizer.from_dir(model_dir()).special_token_ids)
    assert not specials & {t for r in reqs for t in r.prompt_token_ids}


def test_cli_writes_summary_records_and_plots(stack, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "duet.cli", "bench", "run", "--url", stack.url, "--model", str(model_dir()),
         "--workload", "chat", "--num-requests", "6", "--rate", "50", "--max-tokens", "4",
         "--max-prompt-tokens", "256", "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000", "--out", str(out),
         "--json", "--no-progress"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["num_ok"] == 6 and summary["slo"] == {"ttft_ms": 5000, "itl_ms": 1000}
    assert json.loads((out / "summary.json").read_text()) == summary
    assert len((out / "records.jsonl").read_text().splitlines()) == 6
    assert "| all | 6 |" in (out / "summary.md").read_text()
    assert (out / "latency_cdf.png").stat().st_size > 5_000 and (out / "throughput.png").stat().st_size > 5_000


@pytest.mark.parametrize("args, message", [
    (["--workload", "chat", "--rate", "1", "--concurrency", "2"], "give --rate or --concurrency, not both"),
    (["--workload", "chat", "--trace", "mooncake", "--rate", "1"], "--trace applies to trace workloads only"),
    (["--workload", "chat"], "this workload has no arrival times: give --rate R or --concurrency C"),
    (["--workload", "mix", "--mix", "chat=1,video=2", "--rate", "1"], "--mix: unknown class 'video'"),
    (["--workload", "chat", "--rate", "-1"], "--rate must be positive"),
    (["--workload", "chat", "--rate", "1", "--max-tokens", "5000"], "leaves no room for a prompt"),
    (["--workload", "mooncake", "--trace", "/nonexistent.jsonl", "--rate", "1"], "trace file not found"),
])
def test_bad_arguments_give_one_clear_line(args, message, capsys):
    code = bench_main(["run", "--url", "http://127.0.0.1:9", "--model", str(model_dir()), "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert err.startswith("duet bench run: error: ")


@dataclass
class Engine(Sim):
    """A real `duet engine paged|prefix` worker on the tiny model (Sim's wait and kill work for it)."""

    def start(self, log_dir: Path) -> Engine:
        args = [sys.executable, "-m", "duet.cli", "engine", self.kind, "--model", str(model_dir()),
                "--port", str(self.port), "--device", "cpu", "--kv-cache-tokens", "8192"]
        with open(log_dir / f"{self.kind}-{self.port}.log", "wb") as log:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self


def test_real_engines_serve_agent_loops_and_the_prefix_engine_reuses_the_history(tmp_path, src, tokenizer):
    engines = [Engine("prefix"), Engine("paged")]
    try:
        for e in engines:
            e.start(tmp_path)
        for e in engines:
            e.wait(timeout_s=120)
        gw = GatewayThread(gateway_config(engines)).start()
        try:
            # one at a time: agent loops carry a session key, so even their first call goes to the prefix
            # engine (multi_turn), where the second loop finds the first loop's tool descriptions cached;
            # each loop's next step follows its worker
            requests = agent(src, 4, 512, 4, steps=2)
            records = run_benchmark(gw.url, MODEL, requests, concurrency=1, encode=tokenizer.encode,
                                    keep_prompts=True, progress=False)
        finally:
            gw.stop()
    finally:
        for e in engines:
            e.kill()
    assert all(r.ok for r in records), [r.error for r in records]
    assert all(r.output_tokens == 4 for r in records)
    by_id = {r.request_id: r for r in records}
    assert [by_id[f"agent-{i}-t0"].engine for i in (0, 1)] == ["prefix", "prefix"]
    assert [by_id[f"agent-{i}-t0"].route_reason for i in (0, 1)] == ["multi_turn", "multi_turn"]
    assert by_id["agent-1-t0"].cached_tokens > 0  # the shared tool descriptions
    for i in (0, 1):
        first, second = by_id[f"agent-{i}-t0"], by_id[f"agent-{i}-t1"]
        assert second.worker == first.worker and second.route_reason == "affinity"
        assert second.prompt_token_ids[: first.prompt_tokens] == first.prompt_token_ids
    # the prefix engine served the resent history (the previous call's prompt) from its cache
    assert by_id["agent-1-t1"].cached_tokens >= by_id["agent-1-t0"].prompt_tokens - 16
