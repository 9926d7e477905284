"""Flow control under a two-tenant flood (issue 45): one API key sends ten times the other's load.

One real `duet engine paged` worker on the tiny model, one request at a time, each step slowed on purpose
(DUET_DEBUG_STEP_DELAY_MS) so that its capacity is a few requests a second; one-token answers, so a request
is one prefill step and the engine's measured prefill rate is its whole capacity. The light tenant sends
0.15 of that capacity, the heavy one the light's load times ten (1.5 times the capacity). Both use the OpenAI SDK against the gateway with `max_queue_wait_s` low. With fair
shares of the queue:
- the light tenant is never refused and its TTFT p99 stays within its class's SLO (oneshot, cpu profile);
- the heavy tenant's excess is refused at once: 429 `queue_wait_exceeded` with Retry-After;
- nothing is lost: every request is answered or refused, and the engine started exactly the answered ones
  (its prompt-token counter), so no refused request was retried into it.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from duet.launcher import EngineLimits, WorkerSpec, worker_argv
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from duet.traffic_classes import CPU, bound_of
from engine_core.step_loop import DEBUG_STEP_DELAY_ENV
from tests.support.stack import DIE_WITH_TEST, ROOT, GatewayThread, free_port, model_dir

MODEL = model_dir().name
PROMPT_TOKENS = 256  # one prefill step (max_num_batched_tokens 512), under the document size: class oneshot
STEP_DELAY_MS = 200  # a request takes one step: about five a second
MAX_QUEUE_WAIT_S = 1.0
LIGHT_SHARE = 0.15  # of the worker's measured capacity: with the heavy tenant's, 1.65 times it
HEAVY_FACTOR = 10
FLOOD_S = 24.0
KEYS = {"light": "sk-light", "heavy": "sk-heavy"}


@pytest.fixture
def engine(tmp_path: Path):
    port = free_port()
    limits = EngineLimits(kv_cache_tokens=8192, max_num_seqs=1, max_num_batched_tokens=512)
    spec = WorkerSpec("paged", model_dir(), port, worker_id="paged-0", device="cpu", limits=limits)
    with open(tmp_path / "paged.log", "wb") as log:
        proc = subprocess.Popen(worker_argv(spec), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **{DEBUG_STEP_DELAY_ENV: str(STEP_DELAY_MS)}),
                                **DIE_WITH_TEST)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=10)


def _load(address: str) -> pb.EngineLoad:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.EngineStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5.0)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 999) for _ in range(PROMPT_TOKENS)]  # distinct: no cache hit shortens a prefill


async def _one(client: openai.AsyncOpenAI, prompt: list[int]) -> dict:
    t0 = time.monotonic()
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text is not None:
                ttft = time.monotonic() - t0
        return {"status": 200, "ttft_s": ttft}
    except openai.APIStatusError as e:
        return {"status": e.status_code, "code": (e.body or {}).get("code"),
                "retry_after": e.response.headers.get("retry-after")}


async def _tenant(url: str, key: str, rate: float, seed: int) -> list[dict]:
    """Open loop: one request every 1/rate seconds for FLOOD_S, whatever the answers."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    rng = random.Random(seed)
    tasks, t0 = [], time.monotonic()
    for i in range(int(FLOOD_S * rate)):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(_one(client, _prompt(rng))))
    out = await asyncio.gather(*tasks)
    await client.close()
    return out


async def _flood(url: str, light_rate: float) -> dict[str, list[dict]]:
    light, heavy = await asyncio.gather(_tenant(url, KEYS["light"], light_rate, 1),
                                        _tenant(url, KEYS["heavy"], light_rate * HEAVY_FACTOR, 2))
    return {"light": light, "heavy": heavy}


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def test_the_light_tenant_keeps_its_slo_while_the_heavy_one_s_excess_is_refused(engine):
    raw = {"host": "127.0.0.1", "port": free_port(), "models": [{"path": str(model_dir())}],
           "workers": [{"address": engine}], "health": {"poll_interval_s": 0.2},
           "auth": {"api_keys": list(KEYS.values())}, "limits": {"max_queue_wait_s": MAX_QUEUE_WAIT_S}}
    gw = GatewayThread(raw).start(timeout_s=120)
    try:
        warm = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["light"], max_retries=0, timeout=60)
        rng = random.Random(0)
        for _ in range(4):  # the worker measures its prefill rate: admission has an estimate from then on
            warm.completions.create(model=MODEL, prompt=_prompt(rng), max_tokens=1, extra_body={"ignore_eos": True})
        time.sleep(0.5)  # the gateway's load poll picks the rate up
        rate = _load(engine).prefill_tokens_per_s
        assert rate > 0, "the worker measured no prefill rate"
        capacity = rate / PROMPT_TOKENS  # requests a second
        before = _load(engine).prefix_cache_queries_tokens
        results = asyncio.run(_flood(gw.url, LIGHT_SHARE * capacity))
        metrics = httpx.get(gw.url + "/metrics").text
        after = _load(engine).prefix_cache_queries_tokens
    finally:
        gw.stop()

    light, heavy = results["light"], results["heavy"]
    summary = {name: {"sent": len(rs), "ok": sum(r["status"] == 200 for r in rs),
                      "refused": sum(r["status"] == 429 for r in rs)} for name, rs in results.items()}
    summary["capacity_rps"] = round(capacity, 2)
    # nothing lost: each request answered (its one token) or refused with 429 + Retry-After in OpenAI's shape
    for rs in (light, heavy):
        for r in rs:
            assert r["status"] in (200, 429), (r, summary)
            if r["status"] == 200:
                assert r["ttft_s"] is not None, summary
            else:
                assert r["code"] == "queue_wait_exceeded" and int(r["retry_after"]) >= 1, r
    # the light tenant: all answered, first tokens within its class's SLO
    slo_s = bound_of("oneshot", CPU).ttft_bound_ms(PROMPT_TOKENS) / 1000
    assert summary["light"]["ok"] == len(light) >= 6, summary
    light_p99 = _p99([r["ttft_s"] for r in light])
    assert light_p99 <= slo_s, (light_p99, slo_s, summary)
    # the heavy tenant: its excess refused (it sent 1.5 times the worker's capacity)
    assert summary["heavy"]["refused"] >= 0.05 * len(heavy), summary
    assert f'duet_admission_refused_total{{band="standard",model="{MODEL}"}} ' \
           f'{float(summary["heavy"]["refused"])}' in metrics, metrics
    # the engine started exactly the answered requests: no refused one, no retry
    answered = summary["light"]["ok"] + summary["heavy"]["ok"]
    assert after - before == answered * PROMPT_TOKENS, (after - before, answered, summary)
