"""`duet bench advise --validate` (loadtests/advise/validate.py): the recommended deployment run for real on the
captured workload, advise's predicted goodput and TTFT p50 beside the measured ones."""

from __future__ import annotations

import json

import pytest

from duet.model_make import default_model_dir
from loadtests.cli import main

REQUESTS, GAP_MS, OUTPUT = 20, 250.0, 8
SPAN_S = (REQUESTS - 1) * GAP_MS / 1000


def write_capture(path) -> None:
    """A capture's shape: 20 requests at 4 per second, four in five opening with one 1,024-token system prompt
    (two shared blocks), every prompt 1,124 tokens, 8 output tokens (fields as gateway/control/capture.py
    writes them; the hashes as large as its salted ones)."""
    lines = []
    for i in range(REQUESTS):
        own = (1 << 40) + 3 * i
        ids = [(1 << 41) + 7, (1 << 41) + 8, own] if i % 5 else [own, own + 1, own + 2]
        lines.append(json.dumps({"timestamp": i * GAP_MS, "input_length": 1124, "output_length": OUTPUT,
                                 "hash_ids": ids, "session": "", "class": "", "engine": "prefix", "model": "tiny",
                                 "ttft_ms": 20.0, "tpot_ms": 5.0}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(300)
def test_validate_runs_the_recommendation_here_and_prints_both_sides(tmp_path, capsys):
    capture = tmp_path / "capture.jsonl"
    write_capture(capture)
    out = tmp_path / "advice"
    rows_file = tmp_path / "per-request.jsonl"
    assert main(["advise", "--trace", str(capture), "--validate", "--model", str(default_model_dir()),
                 "--out", str(out), "--per-request", str(rows_file)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "advice.json").read_text())
    assert result["cost_model"] == "cpu" and result["workers"] == 2  # this machine's model, one worker per core
    v = result["validation"]
    chosen = result["recommendation"]["deployment"]
    split = result["recommendation"]["split"]
    assert v["deployment"] == chosen
    assert v["kinds"] == ["paged"] * split["paged"] + ["prefix"] * split["prefix"]
    assert v["router"] == ("sglang" if chosen.startswith("all_") else "duet")
    assert v["requests"] == REQUESTS and v["errors"] == 0  # every captured request replayed, none failed
    option = result["rates"]["traffic"]["options"][chosen]
    for key in ("goodput_rps", "ttft_p50_s"):
        f = v[key]
        assert f["predicted"] == option[key]  # advise's own figure for the option it recommends
        assert f["ratio"] == pytest.approx(f["measured"] / f["predicted"], rel=0.01)
        assert f["error"] == pytest.approx(abs(f["predicted"] - f["measured"]) / f["measured"], rel=0.01)
        assert f["within_target"] == (f["error"] <= 0.15)  # the tiny model measures some goodput
    # the tiny model answers in milliseconds, far within the cpu SLOs: every request counts
    assert v["goodput_rps"]["measured"] == pytest.approx(REQUESTS / SPAN_S, rel=0.15)
    assert 0 < v["ttft_p50_s"]["measured"] < 2.0
    # the workers' traced steps against the fit (whether the machine ran as fast as when the fit was measured):
    # the workers that served, named by kind, each request's 8 tokens at least 8 steps of one of them
    steps = v["local_steps_vs_cpu_model"]
    assert steps and {worker.split("-")[0] for worker in steps} <= set(v["kinds"])
    assert sum(w["steps"] for w in steps.values()) >= OUTPUT
    assert (v["dtype"], v["threads"]) == ("float32", 1)  # the repository's fit's (the tests' fit, conftest.py)
    assert "traced forwards over the fit's seconds" in printed
    # --per-request: both sides of each request; the simulated side is advise's own run of the option again
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert len(rows) == REQUESTS and all(r["local"] is not None and r["local"]["error"] is None for r in rows)
    assert {r["sim"]["engine"] for r in rows} <= set(v["kinds"])
    import statistics

    from loadtests.sim.fleet.report import _pct  # the simulator's own p50

    assert _pct([r["sim"]["ttft_s"] for r in rows], 0.5) == pytest.approx(v["ttft_p50_s"]["predicted"], abs=1e-3)
    assert statistics.median(r["local"]["ttft_s"] for r in rows) == pytest.approx(v["ttft_p50_s"]["measured"], abs=1e-3)
    assert "## Validation: " + chosen in printed
    row = next(line for line in printed.splitlines() if line.startswith("| goodput_rps |"))
    assert str(v["goodput_rps"]["predicted"]) in row and str(v["goodput_rps"]["measured"]) in row


@pytest.mark.parametrize("args, message", [
    (("--validate",), "--validate replays a trace file (--trace FILE) or a gateway's capture"),
    (("--fleet", "--per-request", "rows.jsonl"), "--per-request goes with --validate"),
    (("--validate", "--simulate", "--trace", "mooncake"), "--validate checks the fleet simulator's prediction"),
    (("--validate", "--trace", "mooncake"), "--validate replays a trace file (--trace FILE) or a gateway's capture"),
    # with --from-gateway the flags are accepted and the capture is fetched first
    (("--validate", "--from-gateway", "http://127.0.0.1:9"), "cannot reach http://127.0.0.1:9/admin/capture"),
    (("--validate", "--from-gateway", "http://127.0.0.1:9", "--cost-model", "h200"),
     "--validate runs the recommendation on this machine, so advise predicts with the cpu cost model"),
])
def test_validate_flags_are_checked(args, message, capsys):
    assert main(["advise", *args]) == 2
    assert capsys.readouterr().err.strip().startswith(f"duet bench advise: error: {message}")


def test_validate_refuses_a_gpu_cost_model(tmp_path, capsys):
    capture = tmp_path / "capture.jsonl"
    write_capture(capture)
    assert main(["advise", "--trace", str(capture), "--validate", "--cost-model", "h200"]) == 2
    assert "advise predicts with the cpu cost model (fitted here), not 'h200'" in capsys.readouterr().err


def test_the_validated_stack_computes_in_the_dtype_the_cpu_fit_timed(tmp_path, monkeypatch):
    # the stack computes in the dtype the cpu fit records (the repository's: float32), not the checkpoint's own nor
    # what `--dtype auto` picks here (bf16 on an AMX CPU): steps the fit does not describe (tests/loadtests/
    # test_cpu_fit.py: a fit that records none, and one at bf16 and two threads)
    import shutil

    from loadtests.sim.fleet import validate
    from loadtests.stack import pinning

    checkpoint = tmp_path / "bf16-tiny"
    shutil.copytree(default_model_dir(), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("dtype", None)
    (checkpoint / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    seen = {}
    monkeypatch.setattr(pinning, "pinned_stack", lambda model, kinds, limits, *a, **k: seen.update(limits=limits))
    validate.cpu_stack(("prefix", "prefix"), model=str(checkpoint))
    assert (seen["limits"].dtype, seen["limits"].torch_threads) == ("float32", 1)


def test_the_prediction_validate_checks_sends_every_request_at_its_arrival_as_the_replay_does(tmp_path):
    # a capture without session keys: Mooncake's rule makes the 16 requests that share the system prompt one
    # conversation (loadtests/traces/mooncake.session_key). advise alone holds each turn for the previous answer;
    # --validate's local client sends every request at its own arrival time, so the prediction it checks must too
    from loadtests.advise.cli import _fleet_settings, mode_of
    from loadtests.cli import build_parser
    from loadtests.sim.fleet.bench import specs, stack_sim

    capture = tmp_path / "capture.jsonl"
    write_capture(capture)
    capture.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "session"}) + "\n"
                               for line in capture.read_text().splitlines()))
    sent = {}
    for flags in (["--validate"], ["--fleet", "--cost-model", "cpu", "--workers", "2"]):
        args = build_parser().parse_args(["advise", "--trace", str(capture), *flags])
        mode_of(args)
        s = _fleet_settings(args)
        spec = next(x for x in specs(s) if x.name == "all_prefix")
        sim, _ = stack_sim(spec, s)
        sent[s.chain_sessions] = {x.req.request_id: (x.sent_s, x.req.arrival_s) for x in sim.run()}
    assert set(sent) == {False, True}  # --validate: open loop; advise alone: chained turns
    assert all(t == arrival for t, arrival in sent[False].values())
    assert any(t > arrival for t, arrival in sent[True].values())  # some turn waited for the previous answer
