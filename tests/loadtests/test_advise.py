"""`duet bench advise`: the three trace formats, the simulated comparison, the recommendation and its
markdown / JSON / PNG outputs."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.advise.rule import recommend
from loadtests.traces import shipped
from loadtests.traces.formats import detect_format, load_any
from loadtests.traces.mooncake import TraceError

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadtests.cli", "advise", *args], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def openai_log(path: Path) -> Path:
    """Two conversations that resend their history, and unrelated one-shot documents."""
    lines = []
    t = 0.0
    for conv in range(2):
        history = [{"role": "system", "content": "You are terse. " * 300}]
        for turn in range(4):
            history.append({"role": "user", "content": f"conversation {conv} turn {turn} " + "word " * 600})
            lines.append({"timestamp": t, "request": {"model": "m", "messages": list(history), "max_tokens": 50,
                                                      "user": f"u{conv}"}, "response": {"usage": {"completion_tokens": 40}}})
            history.append({"role": "assistant", "content": "ok " * 40})
            t += 0.5
    for doc in range(4):
        lines.append({"timestamp": t, "prompt": f"document {doc} " + "text " * 3000, "max_tokens": 8})
        t += 0.25
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_an_openai_log_keeps_the_conversations_shared_prefixes(tmp_path):
    records = load_any(openai_log(tmp_path / "log.jsonl"))
    assert detect_format(tmp_path / "log.jsonl") == "openai" and len(records) == 12
    turns = [r for r in records if r.session == "u0"]
    # each turn's prompt starts with the previous turn's: its first block ids repeat
    assert turns[1].hash_ids[: len(turns[0].hash_ids) - 1] == turns[0].hash_ids[:-1]
    assert [r.output_length for r in turns] == [40] * 4
    docs = [r for r in records if r.session is None]
    assert len(docs) == 4 and len({r.hash_ids[0] for r in docs}) == 4  # unrelated: nothing shared


def test_the_azure_csv_has_no_reuse_and_the_mooncake_trace_does():
    azure = load_any(shipped.path_of("azure_code"))
    assert len(azure) == 8819 and len({h for r in azure for h in r.hash_ids}) == sum(len(r.hash_ids) for r in azure)
    assert azure[0].timestamp_ms == 0 and all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(azure))
    assert detect_format(shipped.path_of("mooncake")) == "mooncake"


def test_bad_traces_name_the_problem(tmp_path):
    bad = tmp_path / "x.txt"
    bad.write_text("hello\n")
    with pytest.raises(TraceError, match="not a Mooncake JSONL, Azure CSV or OpenAI request log"):
        load_any(bad)
    out = run_cli("--simulate", "--trace", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "trace file not found" in out.stderr and "Traceback" not in out.stderr


def stack(goodput: float, p99: float, paged: int, prefix: int) -> dict:
    return {"goodput_rps": goodput, "ttft_p99_s": p99, "workers": {"paged": paged, "prefix": prefix}}


def test_the_recommendation_needs_duet_to_clearly_win():
    homogeneous = {"all_paged": stack(1.0, 5.0, 4, 0), "all_prefix": stack(1.0, 5.0, 0, 4)}
    clear = recommend({**homogeneous, "duet_1": stack(1.3, 4.0, 1, 3)}, reuse=0.3)
    assert clear["engine"] == "both" and clear["split"] == {"paged": 1, "prefix": 3}
    slim = recommend({**homogeneous, "duet_1": stack(1.03, 4.0, 1, 3)}, reuse=0.3)
    assert slim["engine"] == "prefix"  # a 3% gain is not worth two engine kinds; high reuse -> prefix
    assert recommend({**homogeneous, "duet_2": stack(1.03, 4.0, 2, 2)}, reuse=0.01)["engine"] == "paged"
    nobody_met_the_slo = recommend({"all_paged": stack(0.0, 9.0, 4, 0), "all_prefix": stack(0.0, 9.0, 0, 4),
                                    "duet_2": stack(0.0, 8.0, 2, 2)}, reuse=0.3)
    assert nobody_met_the_slo["engine"] == "prefix"  # a tie in goodput is no case for two kinds
    worse_tail = recommend({**homogeneous, "duet_2": stack(1.5, 6.0, 2, 2)}, reuse=0.3)
    assert worse_tail["engine"] != "both"


@pytest.mark.parametrize("name,limit", [("mooncake", "2000"), ("azure_conv", "2000")])
def test_advise_simulates_the_shared_traces_and_writes_markdown_json_and_png(tmp_path, name, limit):
    out = run_cli("--simulate", "--trace", name, "--workers", "4", "--limit", limit,
                  "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "**Recommendation:" in out.stdout
    result = json.loads((tmp_path / "advice.json").read_text())
    assert set(result["stacks"]) == {"all_paged", "all_prefix", "duet_1", "duet_2", "duet_3", "prefix_duet_routing"}
    rec = result["recommendation"]
    assert rec["engine"] in ("paged", "prefix", "both") and sum(rec["split"].values()) == 4
    if name.startswith("azure"):  # no prefix reuse at all: a second engine kind cannot help
        assert rec["engine"] == "paged" and rec["reuse_share"] == 0
    assert (tmp_path / "advice.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "advice.md").read_text().startswith("# duet bench advise")


def test_advise_reads_an_openai_log(tmp_path):
    out = run_cli("--simulate", "--trace", str(openai_log(tmp_path / "log.jsonl")), "--workers", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["format"] == "openai" and result["records"] == 12
    assert result["recommendation"]["reuse_share"] > 0.3  # the conversations resend their history


def test_a_gain_that_one_kind_gets_behind_duets_router_is_credited_to_the_router():
    homogeneous = {"all_paged": stack(1.0, 5.0, 4, 0), "all_prefix": stack(1.0, 5.0, 0, 4)}
    options = {**homogeneous, "duet_1": stack(1.3, 4.0, 1, 3), "prefix_duet_routing": stack(1.3, 4.0, 0, 4)}
    rec = recommend(options, reuse=0.3)
    assert (rec["deployment"], rec["engine"], rec["router"]) == ("prefix_duet_routing", "prefix", "duet")
    assert rec["split"] == {"paged": 0, "prefix": 4} and "routing's" in rec["why"]
    options["duet_1"] = stack(1.5, 4.0, 1, 3)  # past the margin over one kind behind Duet's router too
    assert (recommend(options, reuse=0.3)["deployment"], recommend(options, reuse=0.3)["engine"]) == ("duet_1", "both")


@pytest.mark.parametrize("args, message", [
    (("--simulate", "--fleet"), "give --simulate or --fleet, not both"),
    (("--simulate", "--cost-model", "cpu"), "--cost-model does not apply to --simulate; it is for --fleet"),
    (("--fleet", "--cache-blocks", "64"),
     "--cache-blocks does not apply to --fleet; it is for --simulate and the local replay"),
    (("--simulate", "--model", "m"), "--model does not apply to --simulate; it is for the local replay"),
    (("--window-s", "60"), "--window-s does not apply to the local replay; it is for --fleet"),
    (("--from-gateway", "http://127.0.0.1:9", "--trace", "mooncake"),
     "--from-gateway replays the gateway's capture in the fleet simulator: give neither --simulate nor --trace with it"),
    (("--admin-key", "k"), "--admin-key goes with --from-gateway"),
    (("--from-gateway", "http://127.0.0.1:9"), "cannot reach http://127.0.0.1:9/admin/capture: "),
])
def test_a_flag_of_another_mode_is_refused_not_ignored(args, message, capsys):
    from loadtests.cli import main

    assert main(["advise", *args]) == 2
    assert capsys.readouterr().err.strip().startswith(f"duet bench advise: error: {message}")


def test_the_fleet_mode_writes_markdown_json_and_png_too(tmp_path):
    out = run_cli("--fleet", "--workers", "2", "--window-s", "2", "--class-slo", "chat.ttft=30000,document.ttft=30000",
                  "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "advice.json").read_text())
    chosen = result["recommendation"]["deployment"]
    markdown = (tmp_path / "advice.md").read_text()
    assert markdown.startswith("# duet bench advise --fleet") and f"**Recommendation: {chosen}**" in markdown
    assert markdown in out.stdout
    assert (tmp_path / "advice.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
