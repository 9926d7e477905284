"""Dispatch, retries and cancellation, against fake engines whose streams each test scripts
(tests/support/fake_engine.py): a worker that fails before its first token and the retry that goes
elsewhere, one that fails mid-stream, a client that leaves. The same paths over real gRPC and real sim
processes: tests/gateway/test_api_resilience.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.fake_engine import Delay, Fail, FakeEngine, Hang, Sim, Started, Tokens
from tests.support.stack import model_dir

MODEL = model_dir().name
MSG = [{"role": "user", "content": "hello"}]


def _events(text: str) -> list[str]:
    return [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]


async def test_failure_before_first_token_is_retried_on_another_worker(fake_gateway):
    engines = (FakeEngine("paged", fail_rate=1.0), FakeEngine("paged"))
    gw = await fake_gateway(*engines, health={"poll_interval_s": 30})
    c = gw.openai()
    for i in range(4):
        raw = await c.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}", max_tokens=2)
        assert raw.parse().choices[0].finish_reason == "length"
        assert raw.headers["x-duet-worker"] == engines[1].address
    assert "duet_worker_retries_total" in (await gw.http.get("/metrics")).text


async def test_a_worker_failing_after_started_is_retried_elsewhere_with_the_same_request(fake_gateway):
    first, second = FakeEngine("paged", worker_id="first"), FakeEngine("prefix", worker_id="second")
    gw = await fake_gateway(first, second)
    first.script([Started(), Delay(0.01), Fail("UNAVAILABLE", "connection reset")])
    second.script([Started(), Tokens([11]), Tokens([12], finish="length")])
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "a one-shot prompt",
                                                    "max_tokens": 2, "seed": 5})
    assert r.status_code == 200, r.text
    # a fresh one-shot prompt goes to engine_paged first; its failure sends the same request to the other
    assert r.headers["x-duet-worker"] == "second"
    assert [len(first.requests), len(second.requests)] == [1, 1]
    assert first.requests[0] == second.requests[0]
    assert r.json()["usage"]["completion_tokens"] == 2
    metrics = (await gw.http.get("/metrics")).text
    assert 'duet_worker_retries_total{worker="first"} 1.0' in metrics
    assert 'duet_worker_retries_total{worker="second"}' not in metrics
    assert not gw.gateway.fleet.get("first").healthy  # left out until its next good health check


async def test_an_engine_refusing_the_request_is_a_400_and_no_other_worker_is_tried(fake_gateway):
    paged, prefix = FakeEngine("paged"), FakeEngine("prefix")
    gw = await fake_gateway(paged, prefix)
    paged.script([Fail("INVALID_ARGUMENT", "logit bias out of range")])
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "one shot", "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "the engine rejected the request: logit bias out of range" in r.json()["error"]["message"]
    assert [len(paged.requests), len(prefix.requests)] == [1, 0]


async def test_a_worker_refusing_for_load_is_a_429_and_the_request_is_not_sent_elsewhere(fake_gateway):
    """Flow control: a busy worker means a loaded pool; a retry would add to it (vllm-router's retry storms)."""
    paged, prefix = FakeEngine("paged"), FakeEngine("prefix")
    gw = await fake_gateway(paged, prefix)
    paged.script([Fail("RESOURCE_EXHAUSTED", "64 requests in flight")])
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "one shot", "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "engine_overloaded" and "64 requests in flight" in err["message"]
    assert [len(paged.requests), len(prefix.requests)] == [1, 0]
    assert gw.gateway.fleet.get(paged.worker_id).healthy  # busy is not broken
    assert gw.gateway.pending.count == 0


async def test_every_worker_failing_before_its_first_token_is_a_502_naming_the_last_error(fake_gateway):
    engines = [FakeEngine("paged", worker_id=f"w{i}") for i in range(4)]
    gw = await fake_gateway(*engines, limits={"max_attempts": 3})
    for e in engines:
        e.script([Fail("UNAVAILABLE", f"{e.worker_id} is down")])
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 2})
    assert r.status_code == 502, r.text
    assert sorted(len(e.requests) for e in engines) == [0, 1, 1, 1]  # three attempts, three different workers
    message = r.json()["error"]["message"]
    last = message.rsplit("last error: worker ", 1)[-1].split(":")[0]
    assert last in {e.worker_id for e in engines if e.requests}
    assert message == f"3 workers failed before the first token; last error: worker {last}: UNAVAILABLE: {last} is down"
    assert gw.gateway.pending.count == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_worker_failing_mid_stream_is_an_error_never_a_silent_truncation(fake_gateway, stream):
    paged, prefix = FakeEngine("paged", worker_id="flaky"), FakeEngine("prefix")
    gw = await fake_gateway(paged, prefix)
    paged.script([Sim(4), Fail("UNAVAILABLE", "worker went away")])  # started + three tokens, then the failure
    body = {"model": MODEL, "prompt": "tell me more", "max_tokens": 20, "stream": stream}
    r = await gw.http.post("/v1/completions", json=body)
    assert r.headers["x-duet-worker"] == "flaky"
    if stream:  # the answer had begun: the client gets the tokens so far, then an error event
        assert r.status_code == 200
        events = _events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [bool(c.get("choices")) for c in chunks] == [True] * (len(chunks) - 1) + [False]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        error = chunks[-1]["error"]
    else:
        assert r.status_code == 502
        error = r.json()["error"]
    assert error["type"] == "engine_error"
    assert error["message"] == "worker flaky failed mid-stream: UNAVAILABLE: worker went away"
    assert len(prefix.requests) == 0  # tokens were sent: no retry could give the same answer
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 2})
    assert r.status_code == 200 and gw.gateway.pending.count == 0


async def test_a_killed_worker_s_streams_end_with_an_error_and_later_requests_go_elsewhere(fake_gateway):
    victim, other = (FakeEngine("prefix", worker_id=w, ms_per_token=20.0) for w in ("victim", "other"))
    gw = await fake_gateway(victim, other)
    c = gw.openai()
    streaming = asyncio.create_task(gw.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MSG, "max_tokens": 200, "stream": True}))
    assert await gw.wait_for(lambda: any(s.sent >= 3 for e in (victim, other) for s in e.open_streams))
    holder = victim if victim.open_streams else other
    holder.kill()
    r = await streaming
    assert "mid-stream" in _events(r.text)[-2]
    for i in range(4):
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
        assert raw.parse().choices[0].finish_reason == "length"
        assert raw.headers["x-duet-worker"] != holder.worker_id


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_cancels_the_engine_call_and_frees_its_pages(fake_gateway, stream):
    engine = FakeEngine("prefix", ms_per_token=20.0)  # the sim's own answer, 500 tokens of it
    gw = await fake_gateway(engine)
    body = {"model": MODEL, "messages": MSG, "max_tokens": 500, "stream": stream}
    status, chunks = await gw.request_and_leave("/v1/chat/completions", body, leave_after_chunks=2 if stream else 0)
    # a stream had begun (200, then it was cut); a whole answer had not, and 499 is "the client closed"
    assert status == (200 if stream else 499)
    assert len(chunks) == (2 if stream else 0)
    assert engine.cancelled == 1
    assert await gw.wait_for(lambda: not engine.sim.running)  # the sim freed the request's pages
    load = await engine.client.get_load()
    assert load.num_running == 0 and load.kv_pages_used == 0
    assert gw.gateway.pending.count == 0
    # the gateway serves the next one as before
    r = await gw.http.post("/v1/chat/completions", json={**body, "max_tokens": 2, "stream": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_a_stop_string_ends_the_answer_and_cancels_the_engine_call(fake_gateway):
    engine = FakeEngine("prefix")
    gw = await fake_gateway(engine)
    tok = gw.gateway.models[MODEL].tokenizer
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    engine.script([Started(), *(Tokens([t]) for t in ids), Hang()])  # no finish: only the stop can end it
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 50,
                                                    "stop": [" gamma"]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "alpha beta" and choice["finish_reason"] == "stop"
    assert engine.cancelled == 1 and not engine.open_streams
