"""`duet bench routers` (issue 45): the report's arithmetic, the peers' command lines, the salted replays, and the
quick mode live: two tiny-model Duet workers behind their one-worker gateways, Duet's gateway in front (and
vllm-router round robin when its virtualenv is already installed: `make test` installs nothing from PyPI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duet.engine_config import ENGINE_DEFAULTS
from duet.model_make import default_model_dir
from loadtests.cli import main as bench_main
from loadtests.experiments.routers import Plan, build_requests, figures, find_rate, median_row, salted
from loadtests.load.client import RequestRecord
from loadtests.stack import peer_routers


def _record(i: int, ttft: float, e2e: float, error: str | None = None, session: str | None = "s") -> RequestRecord:
    return RequestRecord(f"r{i}", "mooncake", session, 300, 16, start_s=float(i), ttft_s=None if error else ttft,
                         e2e_s=None if error else e2e, output_tokens=0 if error else 16, error=error)


def test_a_row_reads_the_engines_counters_and_the_client_s_records():
    # a session turn within the cpu session bound (TTFT 2 s, TPOT 250 ms), one too slow, one failed
    records = [_record(0, 0.5, 2.0), _record(1, 2.5, 4.0), _record(2, 0, 0, error="HTTP 502: x")]
    before = [{"queries": 100, "hits": 10, "requests": 5}, {"queries": 0, "hits": 0, "requests": 0}]
    after = [{"queries": 700, "hits": 310, "requests": 8}, {"queries": 300, "hits": 0, "requests": 1}]
    row = figures(records, before, after, cpu_s=0.3)
    assert row["hit_rate"] == pytest.approx(300 / 900)
    assert row["per_server"] == [3, 1] and row["balance"] == pytest.approx(1.5)
    assert row["engines_saw"] == 4 and row["amplification"] == pytest.approx(4 / 3)  # one request re-sent
    assert row["errors"] == 1 and row["within_slo"] == pytest.approx(1 / 3)
    assert row["goodput_rps"] == pytest.approx(1 / 5.0)  # one good request; sent from 0 s, last done at 5 s
    assert row["router_cpu_s_per_request"] == pytest.approx(0.1)
    assert median_row([{**row, "hit_rate": 0.1}, row, {**row, "hit_rate": 0.9}])["hit_rate"] == pytest.approx(1 / 3)


def test_find_rate_brackets_the_best_peer_s_90_percent_then_looks_between_and_never_replays_a_rate(tmp_path):
    # the best peer keeps 95% within SLO up to 1.2 requests/s, 60% above; Duet (not a peer) is ignored
    replayed = []

    def replay_at(rate: float) -> dict:
        replayed.append(rate)
        return {"duet": {"within_slo": 1.0}, "vllm-router:round_robin": {"within_slo": 0.95 if rate <= 1.2 else 0.6},
                "smg:cache_aware": {"skipped": "install failed"}}

    plan = Plan("vllm", 2, ("duet", "vllm-router:round_robin"), "azure_conv", 120, 1.5, 1, 768, 16,
                default_model_dir(), tmp_path)
    rate, table, tried = find_rate(plan, steps=4, replay_at=replay_at)
    assert replayed == [1.5, 0.75, 1.06, 1.26]  # halve to hold, then the geometric means of the bracket
    assert rate == 1.06 and table["vllm-router:round_robin"]["within_slo"] == 0.95
    assert sorted(tried) == sorted(replayed)
    # every rate held: it keeps doubling, and reports the highest
    rate, _, tried = find_rate(plan, steps=3, replay_at=lambda r: {"vllm-router:round_robin": {"within_slo": 1.0}})
    assert rate == 6.0 and sorted(tried) == [1.5, 3.0, 6.0]


def test_every_peer_runs_from_its_own_virtualenv_and_kv_aware_gets_the_model_and_block_size():
    vr = peer_routers.PEERS["vllm-router"]
    src = peer_routers.KvSource("http://a:1", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    argv = peer_routers.peer_argv(vr, "kv_aware", 9000, ["http://a:1"], model="m", block_size=32, kv_sources=(src,))
    assert argv[0] == str(peer_routers.venv_dir(vr) / "bin" / "python")
    text = " ".join(argv)
    assert "--policy kv_aware" in text and "--kv-event-source http://a:1=tcp://127.0.0.1:5557" in text
    assert "--kv-event-model m" in text and "--kv-event-block-size 32" in text
    assert "--kv-event" not in " ".join(peer_routers.peer_argv(vr, "round_robin", 9000, ["http://a:1"], model="m",
                                                                block_size=32, kv_sources=(src,)))
    with pytest.raises(ValueError, match="unknown router 'smg:kv_aware'"):
        peer_routers.parse_router("smg:kv_aware")


def _plan(tmp_path: Path, requests: int = 24) -> Plan:
    return Plan("duet", 2, ("duet",), "mooncake", requests, 4.0, 1, 512, 16, default_model_dir(), tmp_path)


def _ideal_hit_rate(requests, block: int) -> float:
    """One cache holding every block seen: the most any router can hit on this replay."""
    seen, hit, total = set(), 0, 0
    for r in requests:
        ids = r.prompt_token_ids
        k = 0
        while k < len(ids) // block and tuple(ids[:(k + 1) * block]) in seen:
            k += 1
        hit, total = hit + k * block, total + len(ids)
        seen.update(tuple(ids[:j * block]) for j in range(1, len(ids) // block + 1))
    return hit / total


def test_salted_replays_keep_the_trace_s_shape_and_share_no_block(tmp_path):
    requests, allowed = build_requests(_plan(tmp_path))
    a, b = salted(requests, allowed, 1), salted(requests, allowed, 2)
    assert [len(r.prompt_token_ids) for r in a] == [len(r.prompt_token_ids) for r in requests]
    block = ENGINE_DEFAULTS.page_size
    assert _ideal_hit_rate(a, block) == _ideal_hit_rate(requests, block) > 0.5  # the same shared prefixes
    assert not {r.prompt_token_ids[:block] for r in a} & {r.prompt_token_ids[:block] for r in b}
    assert {t for r in a for t in r.prompt_token_ids} <= set(allowed)


@pytest.mark.timeout(1500)
def test_quick_mode_on_tiny_duet_workers(tmp_path):
    routers = ["duet"]
    if peer_routers.installed(peer_routers.PEERS["vllm-router"]):
        routers.append("vllm-router:round_robin")
    out = tmp_path / "routers.json"
    assert bench_main(["routers", "--engines", "duet", "--routers", ",".join(routers), "--trace", "mooncake",
                       "--requests", "24", "--rate", "4", "--log-dir", str(tmp_path / "logs"),
                       "--json", str(out)]) == 0
    table = json.loads(out.read_text())["mooncake"]["routers"]
    assert list(table) == routers, table
    requests, _ = build_requests(_plan(tmp_path))
    ideal = _ideal_hit_rate(requests, ENGINE_DEFAULTS.page_size)
    for name, row in table.items():
        assert "skipped" not in row, (name, row)
        assert row["errors"] == 0 and row["sent"] == 24, (name, row)
        # the engines saw each request once (no retry), and the balance counts every one of them
        assert row["engines_saw"] == 24 and sum(row["per_server"]) == 24, (name, row)
        # the engines' own counters: about what one shared cache would hit (two servers each start cold), and
        # never more: a router finding blocks an earlier router's replay left would exceed it
        assert 0.8 * ideal <= row["hit_rate"] <= ideal + 0.02, (name, row, ideal)
        assert row["ttft_s"]["p50"] <= row["ttft_s"]["p99"] <= row["e2e_s"]["p99"], (name, row)
        assert row["router_cpu_s_per_request"] > 0, (name, row)
