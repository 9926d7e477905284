"""`duet bench advise --from-gateway` on traffic a vLLM server served: a real gateway in front of a FAKE vLLM-shaped
backend (its HTTP routes, and /metrics counters that move by a known amount with each request it serves), the
gateway's capture of that traffic, and advise calibrating the vLLM kind's step costs from the rates the gateway
measured (loadtests/advise/calibrated.py) and naming them. Before any traffic there is no rate: advise says to send
traffic first. `duet migrate plan` advises with the same calibrated model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from duet.cli import main as duet_main
from duet.launcher import free_port
from duet.tokenizer import Tokenizer
from tests.support.stack import GatewayThread, gateway_config, model_dir

MODEL = model_dir().name
ADMIN_KEY = "adm-calibrate"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# what each request the fake serves adds to its counters: its prompt computed in 0.5 s of prefill (prompt tokens
# / 0.5 s: PROMPT_TOKENS / 0.5 tokens/s), OUTPUT tokens 0.02 s apart, two a step: decode 2 / 0.02 = 100 tokens/s
PROMPT_TOKENS, OUTPUT = 300, 8
PREFILL_RATE, DECODE_RATE = PROMPT_TOKENS / 0.5, 100.0


class FakeVllm:
    """vLLM's routes as the gateway's HTTP backend client uses them (gateway/backends/http_backend.py)."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.from_dir(model_dir())
        self.counters = {"prefill_tokens": 1000.0, "prefill_s": 2.0, "itl_s": 1.0, "itl_n": 50.0, "steps": 25.0}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/health", self.health), Route("/v1/models", self.models),
                                Route("/tokenize", self.tokenize, methods=["POST"]),
                                Route("/metrics", self.metrics),
                                Route("/inference/v1/generate", self.generate, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeVllm:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake vLLM did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    async def health(self, request: Request):
        return PlainTextResponse("")

    async def models(self, request: Request):
        return JSONResponse({"data": [{"id": MODEL, "max_model_len": 2048}]})

    async def tokenize(self, request: Request):
        body = await request.json()
        return JSONResponse({"tokens": self.tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens")))})

    async def metrics(self, request: Request):
        c = self.counters
        rows = [("vllm:num_requests_running", 0), ("vllm:request_prefill_kv_computed_tokens_sum", c["prefill_tokens"]),
                ("vllm:request_prefill_time_seconds_sum", c["prefill_s"]),
                ("vllm:inter_token_latency_seconds_sum", c["itl_s"]),
                ("vllm:inter_token_latency_seconds_count", c["itl_n"]),
                ("vllm:iteration_tokens_total_count", c["steps"])]
        return PlainTextResponse("".join(f'{name}{{model_name="{MODEL}"}} {value}\n' for name, value in rows))

    async def generate(self, request: Request):
        body = await request.json()
        n = body["sampling_params"]["max_tokens"]
        prompt = len(body["token_ids"])

        async def stream():
            for i in range(n):
                chunk = {"choices": [{"index": 0, "token_ids": [100 + i],
                                      "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': prompt}})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            c = self.counters  # the request finished: its prefill and decode reach the counters (module doc)
            c["prefill_tokens"] += prompt
            c["prefill_s"] += prompt / PREFILL_RATE
            c["itl_n"] += n
            c["itl_s"] += n * 0.02
            c["steps"] += n / 2
        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture()
def stack():
    fake = FakeVllm().start()
    raw = gateway_config([], backends=[{"engine": "vllm", "url": fake.url, "block_size": 16}],
                         auth={"admin_key": ADMIN_KEY}, capture={"enabled": True})
    gw = GatewayThread(raw).start(wait_workers=1)
    yield fake, gw
    gw.stop()
    fake.stop()


async def _send(url: str, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for i in range(count):  # one at a time, each prompt its own, PROMPT_TOKENS long
            prompt = [5 + (i * 131 + j * 7) % 900 for j in range(PROMPT_TOKENS)]
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT})
            assert r.status_code == 200, r.text


def _rows(url: str) -> dict:
    return {r["worker_id"]: r for r in httpx.get(url + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]}


@pytest.mark.timeout(300)
def test_advise_from_gateway_calibrates_the_vllm_kind_from_its_measured_rates(stack, tmp_path, capsys):
    fake, gw = stack
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 300, "output_length": 8, "hash_ids": [1]}) + "\n")
    time.sleep(0.6)  # polls that saw the counters stand still: no rate
    row = _rows(gw.url)[fake.url]
    assert (row["engine"], row["engine_kind"], row["prefill_tokens_per_s"], row["decode_tokens_per_s"]) == \
        ("vllm", "paged", 0.0, 0.0)
    capsys.readouterr()
    assert duet_main(["bench", "advise", "--trace", str(trace), "--cost-from-gateway", gw.url,
                      "--admin-key", ADMIN_KEY, "--workers", "2"]) == 2
    assert f"backend vllm ({fake.url}) has no measured prefill or decode rate yet: send traffic first" in \
        capsys.readouterr().err

    asyncio.run(_send(gw.url, 6))
    deadline = time.monotonic() + 20  # a poll after the traffic (every 0.2 s) turns the counters' deltas into rates
    while _rows(gw.url)[fake.url]["decode_tokens_per_s"] == 0.0:
        assert time.monotonic() < deadline, _rows(gw.url)
        time.sleep(0.1)
    row = _rows(gw.url)[fake.url]
    assert row["prefill_tokens_per_s"] == pytest.approx(PREFILL_RATE)
    assert row["decode_tokens_per_s"] == pytest.approx(DECODE_RATE)
    assert (row["prefill_rate_source"], row["page_size"], row["max_model_len"]) == ("engine", 16, 2048)
    assert row["decode_tokens_per_step"] == pytest.approx(2.0)

    out = tmp_path / "advice"
    assert duet_main(["bench", "advise", "--from-gateway", gw.url, "--admin-key", ADMIN_KEY, "--workers", "2",
                      "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    cal = result["calibration"]
    assert result["cost_model"] == "calibrated" and result["served_by"] == ["paged"]
    paged = cal["kinds"]["paged"]
    assert (paged["engine"], paged["workers"]) == ("vllm", [fake.url])
    assert (paged["prefill_tokens_per_s"], paged["decode_tokens_per_s"]) == (PREFILL_RATE, DECODE_RATE)
    # the measured decode step (2 tokens in 20 ms) less two prefill tokens' cost is the step's fixed cost
    assert cal["step_costs"]["paged"] == {"intercept_s": pytest.approx(0.02 - 2 / PREFILL_RATE),
                                          "per_prefill_token_s": pytest.approx(1 / PREFILL_RATE),
                                          "per_decode_token_s": pytest.approx(1 / PREFILL_RATE)}
    assert (cal["slo_profile"], cal["profile"]["page_size"], cal["profile"]["paged_prefill_cap"]) == ("gpu", 16, 0)
    assert result["labels"]["all_paged"] == "all vllm" and result["labels"]["duet_1:1"] == "1 vllm + 1 duet prefix"
    # every option of the answer, at every traffic level, served the capture's requests
    for level in result["rates"].values():
        assert {"all_paged", "all_prefix", "duet_1:1"} <= set(level["options"])
    assert set(result["sensitivity"]) == {"traffic", "half_traffic", "double_traffic"}
    # the markdown names the model's source so a reader knows what the prediction stands on
    text = (out / "advice.md").read_text()
    assert (f"calibrated from vllm backend {fake.url}'s measured rates at " in text
            and f"prefill {PREFILL_RATE:,.0f} tok/s, decode {DECODE_RATE:,.0f} tok/s at 2.00 tokens a step" in text)
    assert "all_paged (all vllm)" in text
    # the move, if any, is said in the engines' names
    move = result["canary"]
    if move["needed"]:
        assert any("duet prefix" in step for step in move["steps"]), move
    else:
        assert move["why"] == "the traffic is served by vllm already"

    # `duet migrate plan` advises on the capture with the same calibrated model, and says so
    assert duet_main(["migrate", "plan", "--gateway", gw.url, "--admin-key", ADMIN_KEY, "--workers", "2"]) == 0
    plan = capsys.readouterr().out
    assert f"advice: paged step costs calibrated from vllm backend {fake.url}'s measured rates at " in plan
    assert "in the fleet simulator, 2 workers, cost model calibrated" in plan
    assert f"advice: run {result['recommendation']['deployment']} " in plan
