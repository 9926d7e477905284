"""The selection path where the options really differ (issue 44's target: advise on the capture gives the same
recommendation as advise on the generating workload). tests/e2e/test_workload_capture.py checks the capture at a
light load, where every option meets its SLOs and the rule's tie order decides; here the traffic is one the
deployments serve very differently, so the answer rests on the captured shape alone: sessions, lengths, shared
prefixes and arrivals.

The workload, judged on the bench machine's cost model (`--cost-model cpu`: 4,096 KV tokens a worker) for 2
workers: chat turns (a session each, so the `session` class: TTFT <= 2 s) that share a 2,048-token system
prompt and add 32 tokens of their own, 2 a second, and three one-shot 2,560-token documents, 8 s apart. A
document and the system prompt do not fit one worker's KV together: where a document lands, the system prompt
is evicted and the chats behind it wait out its prefill (about 10 s) and a re-prefill; Duet's routing over one
paged and one prefix worker sends the documents to the paged one and the chats to the prefix one, and only
then do the chats keep their SLO. Predicted, the split serves 1.48x the goodput of the next option (over 2x
the baselines') at a TTFT p99 1.5x lower, and the answer held in the simulator under every arrival change
tried (18 runs, 11 of them on this workload less one chat: jitter of up to 0.5 s a request, a stall of 1 to 5
s anywhere; the margin fell to 1.21x under one 5 s stall; nearby settings flipped under 2 s stalls, a denser
chat stream under 5 s ones). One chat arrives first and alone, so every option starts from its system prompt
cached (a cold start under a burst is chaotic in every deployment). Without the capture's sessions, or with
its shared prefix lost, advise answers all_prefix instead.

The prompts (2,080 and 2,560 tokens) are past the tiny model's 2,048-token context: the sims and the gateway
serve its 32k-context twin (tests/support/stack.py `long_model_dir`). The gateway is its own process, so the
client's work does not delay its arrival times.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from duet.cli import main as duet_main
from loadtests.advise import fleet
from loadtests.sim.fleet.bench import FleetSettings
from loadtests.traces.mooncake import TraceRecord, load_trace, prompt_token_ids
from tests.support.stack import GatewayProcess, Sim, gateway_config, long_model_dir, start_sims

VOCAB = 1000  # the tiny model's (and its long-context twin's)
ADMIN_KEY = "adm-advise"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SYSTEM_BLOCKS = 4  # the chats' shared system prompt: 4 trace blocks of 512 tokens
CHAT_OWN_TOKENS, CHAT_RATE, CHAT_START_S, CHAT_SPAN_S = 32, 2.0, 6.0, 24.0
DOC_BLOCKS, DOC_AT_S = 5, (2.5, 10.5, 18.5)
OUTPUT = 8
WORKERS, WINDOW_S = 2, 60.0


def workload() -> list[dict]:
    """The generating workload as Mooncake records (module docstring): a first chat alone at 0, the rest from
    CHAT_START_S at CHAT_RATE a second, the documents at DOC_AT_S."""
    recs = []
    times = [0.0] + [CHAT_START_S + (i + 0.5) / CHAT_RATE for i in range(int(CHAT_SPAN_S * CHAT_RATE))]
    for i, t in enumerate(times):
        recs.append({"timestamp": round(t * 1000), "input_length": 512 * SYSTEM_BLOCKS + CHAT_OWN_TOKENS,
                     "output_length": OUTPUT, "hash_ids": [*range(1, SYSTEM_BLOCKS + 1), 1000 + i],
                     "session": f"chat-{i}"})
    for i, t in enumerate(DOC_AT_S):
        recs.append({"timestamp": round(t * 1000), "input_length": 512 * DOC_BLOCKS, "output_length": OUTPUT,
                     "hash_ids": [2000 + DOC_BLOCKS * i + k for k in range(DOC_BLOCKS)], "session": ""})
    return sorted(recs, key=lambda r: r["timestamp"])


async def replay(url: str, model: str, records: list[TraceRecord]) -> float:
    """Each record at its timestamp (a chat with its session header); the largest lateness, seconds."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.5
    late = 0.0

    async def one(rec: TraceRecord) -> None:
        nonlocal late
        prompt = prompt_token_ids(rec, VOCAB, low=3)
        headers = {"x-session-id": rec.session} if rec.session else {}
        await asyncio.sleep(max(0.0, start + rec.timestamp_ms / 1000 - loop.time()))
        late = max(late, loop.time() - start - rec.timestamp_ms / 1000)
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=OUTPUT, temperature=0,
                                              extra_body={"ignore_eos": True}, extra_headers=headers)
        assert out.usage.completion_tokens == OUTPUT

    await asyncio.gather(*(one(r) for r in records))
    await client.close()
    return late


def _wait_healthy(url: str, want: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(url + "/admin/workers", headers=ADMIN, timeout=2)
        if r.status_code == 200 and sum(1 for w in r.json()["workers"] if w.get("healthy")) >= want:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not see {want} healthy workers in {timeout_s}s")


def _decisive(advice: dict) -> dict:
    """What the recommendation rests on: the chosen option's goodput over each other option's."""
    options = advice["rates"]["traffic"]["options"]
    chosen = advice["recommendation"]["deployment"]
    return {name: options[chosen]["goodput_rps"] / max(o["goodput_rps"], 1e-9)
            for name, o in options.items() if name != chosen}


@pytest.mark.timeout(240)
def test_advise_on_the_capture_answers_as_on_the_workload_where_options_differ(tmp_path, capsys):
    path = tmp_path / "workload.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in workload()))
    records = load_trace(path)
    model = long_model_dir()
    sims = start_sims([Sim("prefix", model=model), Sim("paged", model=model)], tmp_path)
    gw = GatewayProcess(gateway_config(sims, model=model, auth={"admin_key": ADMIN_KEY},
                                       capture={"enabled": True}), tmp_path)
    try:
        gw.wait_ready()
        _wait_healthy(gw.url, len(sims))
        late = asyncio.run(replay(gw.url, model.name, records))
        capsys.readouterr()
        assert duet_main(["bench", "advise", "--from-gateway", gw.url, "--admin-key", ADMIN_KEY, "--cost-model",
                          "cpu", "--workers", str(WORKERS), "--window-s", str(WINDOW_S), "--json",
                          "--out", str(tmp_path / "advice")]) == 0
        on_capture = json.loads(capsys.readouterr().out)
    finally:
        gw.stop()
        for s in sims:
            s.kill()
    capture = load_trace(tmp_path / "advice" / "capture.jsonl")
    on_workload = fleet.advise(FleetSettings(cost_model="cpu", workers=WORKERS, mix={str(path): 1.0},
                                             window_s=WINDOW_S))

    # the capture is the workload's shape: every request, its lengths, its sessions
    assert len(capture) == len(records)
    assert sorted(r.input_length for r in capture) == sorted(r.input_length for r in records)
    assert sum(1 for r in capture if r.session) == sum(1 for r in records if r.session)
    spans = [max(r.timestamp_ms for r in rs) - min(r.timestamp_ms for r in rs) for rs in (capture, records)]
    why = f"late by up to {late:.2f} s in the replay; spans {spans} ms"

    # the options really differ: on the workload (the simulator is deterministic) the split serves 1.48x the
    # goodput of the next option and over twice the baselines', at a TTFT p99 lower than any other option's
    margins = _decisive(on_workload)
    assert on_workload["recommendation"]["deployment"] == "duet_1:1", on_workload["recommendation"]
    assert min(margins.values()) >= 1.4 and margins["all_paged"] >= 2 and margins["all_prefix"] >= 2, margins
    options = on_workload["rates"]["traffic"]["options"]
    assert all(o["ttft_p99_s"] > 1.3 * options["duet_1:1"]["ttft_p99_s"] for n, o in options.items() if n != "duet_1:1")
    # the capture gets the workload's answer, on a margin of its own (its arrivals are the replay's real ones)
    assert on_capture["recommendation"]["deployment"] == on_workload["recommendation"]["deployment"], why
    assert min(_decisive(on_capture).values()) > 1.05, (_decisive(on_capture), why)
