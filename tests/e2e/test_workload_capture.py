"""The selection path's first steps on a live stack (sim workers over real gRPC, gateways in this process, the
openai SDK as the client): traffic of a known shape -> the profile reports its repetition; the capture holds the
shape and nothing of the content, round-trips through the Mooncake reader, and `duet bench advise` on it answers
what it answers on the workload that generated it."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from duet.cli import main as duet_main
from duet.launcher import free_port
from gateway.control.rollback import CanaryPolicy
from gateway.control.state.codec import config_from_dict
from loadtests.advise import fleet
from loadtests.sim.fleet.bench import FleetSettings
from loadtests.traces.mooncake import TraceRecord, load_trace, prompt_token_ids
from tests.support.stack import GatewayProcess, GatewayThread, Sim, gateway_config, model_dir, start_sims

MODEL = model_dir().name
VOCAB = 1000  # the tiny test model's
ADMIN_KEY = "adm-profile"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SHARED, REQUESTS, OUTPUT = 0.8, 60, 8
SYSTEM_IDS = (7, 8)  # two trace blocks: a 1,024-token system prompt
UNIQUE_TOKENS = 100


def known_workload(path) -> list[TraceRecord]:
    """60 requests at 10 per second; 80% start with the same 1,024-token system prompt, every one then has 100
    tokens of its own. Written as a Mooncake trace (the generating workload advise also reads)."""
    rng = random.Random(44)
    records, lines = [], []
    shared = set(rng.sample(range(REQUESTS), int(SHARED * REQUESTS)))
    for i in range(REQUESTS):
        own = 1000 + 3 * i
        ids = (*SYSTEM_IDS, own) if i in shared else (own, own + 1, own + 2)
        rec = TraceRecord(i * 100.0, 1024 + UNIQUE_TOKENS, OUTPUT, ids, session="")
        records.append(rec)
        # "session": "" as the replay sends no session: without the field, a Mooncake trace's second block names
        # its conversation (Kimi's layout), and the simulator would chain every request that shares the system
        # prompt as turns of one conversation, each waiting for the last: another workload than the capture's
        lines.append(json.dumps({"timestamp": rec.timestamp_ms, "input_length": rec.input_length,
                                 "output_length": OUTPUT, "hash_ids": list(ids), "session": ""}))
    path.write_text("\n".join(lines) + "\n")
    return records


async def replay(url: str, records: list[TraceRecord]) -> list[list[int]]:
    """Each record's prompt (as token ids) at its timestamp; the prompts, in order."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = [prompt_token_ids(r, VOCAB, low=3) for r in records]

    async def one(rec: TraceRecord, prompt: list[int]) -> None:
        await asyncio.sleep(rec.timestamp_ms / 1000)
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == OUTPUT

    await asyncio.gather(*(one(r, p) for r, p in zip(records, prompts, strict=True)))
    await client.close()
    return prompts


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    started = start_sims([Sim("prefix"), Sim("paged")], tmp_path_factory.mktemp("sims"))
    yield started
    for s in started:
        s.kill()


def _gateway(sims) -> GatewayThread:
    return GatewayThread(gateway_config(sims, auth={"admin_key": ADMIN_KEY}, capture={"enabled": True})).start()


def _gateway_process(sims, tmp) -> GatewayProcess:
    """The gateway as its own process, every sim healthy: the replay's client then shares no interpreter with it,
    so the arrival times it captures are the client's own (in a thread of this process, a loaded machine moved
    them by seconds: another workload, as advise reads it)."""
    gw = GatewayProcess(gateway_config(sims, auth={"admin_key": ADMIN_KEY}, capture={"enabled": True}), tmp)
    gw.wait_ready()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.get(gw.url + "/admin/workers", headers=ADMIN, timeout=2)
        if r.status_code == 200 and sum(1 for w in r.json()["workers"] if w.get("healthy")) == len(sims):
            return gw
        time.sleep(0.2)
    gw.stop()
    raise RuntimeError("the gateway did not see every sim healthy in 30 s")


@pytest.mark.timeout(300)
def test_known_traffic_is_profiled_captured_and_advised_alike(sims, tmp_path, capsys):
    workload = known_workload(tmp_path / "workload.jsonl")
    gw = _gateway_process(sims, tmp_path)
    try:
        prompts = asyncio.run(replay(gw.url, workload))
        # a chat turn with a text to look for in the capture
        secret = "the purple elephant 7731 sings"
        openai.OpenAI(base_url=gw.url + "/v1", api_key="none").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=2,
            extra_headers={"x-session-id": "conversation-secret-42"})

        profile = httpx.get(gw.url + "/admin/profile?window_s=300", headers=ADMIN, timeout=10).json()
        out = tmp_path / "capture.jsonl"
        assert duet_main(["capture", "export", "--gateway", gw.url, "--admin-key", ADMIN_KEY, "--out",
                          str(out)]) == 0
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        capsys.readouterr()
        assert duet_main(["bench", "advise", "--from-gateway", gw.url, "--admin-key", ADMIN_KEY, "--workers", "8",
                          "--window-s", "60", "--json", "--out", str(tmp_path / "advice")]) == 0
        on_capture = json.loads(capsys.readouterr().out)
    finally:
        gw.stop()

    # the profile: the share of prompt tokens that repeat the system prompt sent before, known by construction
    shared = [r for r in workload if r.hash_ids[:2] == SYSTEM_IDS]
    known = (len(shared) - 1) * 1024 / sum(r.input_length for r in workload)
    measured = profile["models"][MODEL]["prefix_repetition"]
    assert measured["cross_session"] == pytest.approx(known, abs=0.05), (measured, known)
    assert measured["within_session"] == 0.0  # no request of the replay has a session
    assert profile["models"][MODEL]["requests"] == REQUESTS + 1
    assert 'duet_profile_prefix_repetition{model="*",scope="cross_session"}' in metrics

    # the capture: Mooncake records the reader takes, one per request, with the workload's lengths and reuse
    records = load_trace(out)
    assert len(records) == REQUESTS + 1
    replayed = [r for r in records if r.session == ""]
    assert sorted(r.input_length for r in replayed) == sorted(r.input_length for r in workload)
    assert all(r.output_length == OUTPUT for r in replayed)
    heads = {}
    for r in replayed:
        heads[r.hash_ids[:2]] = heads.get(r.hash_ids[:2], 0) + 1
    assert max(heads.values()) == len(shared)  # the shared system prompt is one chain of ids
    assert not {h for r in records for h in r.hash_ids} & {h for r in workload for h in r.hash_ids}

    # no content: no text, no token ids, no session key in clear, only the record's fields
    text = out.read_text()
    assert "purple" not in text and "elephant" not in text and "conversation-secret-42" not in text
    for rec in map(json.loads, text.splitlines()):
        assert set(rec) == {"timestamp", "input_length", "output_length", "hash_ids", "session", "class", "engine",
                            "model", "ttft_ms", "tpot_ms"}
        assert all(h >= 1 << 20 for h in rec["hash_ids"])  # salted 64-bit hashes, never token ids (< 1,000)
    for prompt in prompts:
        assert ",".join(map(str, prompt[:4])) not in text.replace(" ", "")

    # advise on the capture (`--from-gateway`, the same flags' defaults) answers as advise on the workload that
    # generated it, and says how to start the move from the deployment that served it
    on_workload = fleet.advise(FleetSettings(cost_model="h200", workers=8, mix={str(tmp_path / "workload.jsonl"): 1.0},
                                             window_s=60.0))
    assert on_capture["recommendation"]["deployment"] == on_workload["recommendation"]["deployment"]
    assert on_capture["sensitivity"] == on_workload["sensitivity"]
    # at this light load every option meets its SLOs and the rule's tie order decides, so the figures must agree
    # too: the capture reproduces the workload's predicted SLO attainment and latency option by option. (Not the
    # goodput in requests a second: that divides by the span of the arrivals, which the replay's real clock
    # stretches or squeezes on a loaded machine: 9.1 and 16.9 against 10.2 req/s at load 20-27.)
    for name, want in on_workload["rates"]["traffic"]["options"].items():
        got = on_capture["rates"]["traffic"]["options"][name]
        assert got["slo_attainment"] == pytest.approx(want["slo_attainment"], abs=0.05), name
        assert got["ttft_p50_s"] == pytest.approx(want["ttft_p50_s"], rel=0.25), name
        assert got["tpot_p50_s"] == pytest.approx(want["tpot_p50_s"], rel=0.25), name
    assert on_capture["served_by"] == ["paged", "prefix"] and "served_by" not in on_workload
    move = on_capture["canary"]
    assert move["needed"] and move["routing"]["variants"][0]["name"] == "current"
    assert CanaryPolicy.from_dict(MODEL, move["canary_policy"]).ramp[-1].weight == 100.0  # the admin API takes it
    config_from_dict(move["routing"]).validate()
    assert (tmp_path / "advice" / "capture.jsonl").read_text() == out.read_text()


@pytest.mark.timeout(120)
def test_the_same_prompt_under_two_deployments_gives_unrelated_ids(sims, tmp_path):
    one, other = _gateway(sims), _gateway(sims)  # each its own in-memory state: its own salt
    prompt = [5 + (i * 37) % 990 for i in range(1100)]
    try:
        for gw in (one, one, other):
            r = httpx.post(gw.url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
        a = [json.loads(line) for line in httpx.get(one.url + "/admin/capture", headers=ADMIN).text.splitlines()]
        b = [json.loads(line) for line in httpx.get(other.url + "/admin/capture", headers=ADMIN).text.splitlines()]
        assert httpx.get(one.url + "/admin/capture").status_code == 401  # the admin key is required
        bad = httpx.get(one.url + "/admin/profile?window_s=0", headers=ADMIN)
        assert bad.status_code == 400 and "window_s must be within (0, 300]" in bad.json()["error"]["message"]
    finally:
        one.stop()
        other.stop()
    assert len(a) == 2 and len(b) == 1
    assert a[0]["hash_ids"] == a[1]["hash_ids"] and len(a[0]["hash_ids"]) == 3  # a repeat matches
    assert not set(a[0]["hash_ids"]) & set(b[0]["hash_ids"])  # another deployment's salt: nothing in common


@pytest.mark.timeout(120)
def test_replicas_sharing_redis_share_one_salt_and_one_capture(sims, clean_redis_url):
    config = gateway_config(sims, auth={"admin_key": ADMIN_KEY}, capture={"enabled": True}, redis=clean_redis_url)
    one = GatewayThread(config).start()
    other = GatewayThread(dict(config, port=free_port())).start()
    prompt = [5 + (i * 41) % 990 for i in range(600)]
    try:
        for gw in (one, other):
            r = httpx.post(gw.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
        time.sleep(1.5)  # each replica flushes its records once a second
        from_one = httpx.get(one.url + "/admin/capture", headers=ADMIN, timeout=10).text.splitlines()
        from_other = httpx.get(other.url + "/admin/capture", headers=ADMIN, timeout=10).text.splitlines()
    finally:
        one.stop()
        other.stop()
    assert from_one == from_other and len(from_one) == 2  # every replica's records, from either
    a, b = (json.loads(line) for line in from_one)
    assert a["hash_ids"] == b["hash_ids"]  # one deployment, one salt: the same prompt has the same ids
