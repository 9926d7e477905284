"""duet/balancer.py in front of two real `duet gateway` processes sharing a real Redis, over sim workers.

A gateway killed while requests wait for their first token must lose none of them (the balancer replays
them on the other gateway); a session keeps its worker whichever replica serves it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from duet.balancer import Backend, Balancer, parse_backend
from tests.support.stack import LiveStack, Sim, chat_body, free_port


def test_parse_backend_and_round_robin_prefers_live():
    assert parse_backend("10.0.0.5:8000") == Backend("10.0.0.5", 8000)
    with pytest.raises(ValueError, match="host:port"):
        parse_backend("gateway")
    a, b, c = Backend("a", 1), Backend("b", 2), Backend("c", 3, live=False)
    lb = Balancer([a, b, c])
    firsts = [lb.candidates()[0].name for _ in range(4)]
    assert firsts == ["a:1", "b:2", "a:1", "b:2"]  # the down backend is never first while others live
    assert lb.candidates()[-1] is c  # but still tried last


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory, redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushall()
    # prefill of ~1.5 s for the prompts below: a kill at 0.5 s finds every request before its first byte
    # two workers of one kind: the replica (not just the kind) must follow the session across gateways
    sims = [Sim("prefix", worker_id="prefix-a", prefill_ms_per_token=25.0),
            Sim("prefix", worker_id="prefix-b", prefill_ms_per_token=25.0)]
    tmp = tmp_path_factory.mktemp("two-gateways")
    stack = LiveStack(tmp, sims, admin_key="test-admin", redis_url=redis_url, gateways=2).start()
    yield stack
    stack.stop()


async def _serve(balancer: Balancer, port: int) -> asyncio.Task:
    started = asyncio.Event()
    task = asyncio.create_task(balancer.serve("127.0.0.1", port, started))
    await asyncio.wait_for(started.wait(), 5)
    return task


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
    """One streaming chat request; returns (worker, text). Raises if the stream breaks."""
    text = []
    async with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        worker = r.headers["x-duet-worker"]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                text.append(line)
        assert len(text) > 1 and text[-1] == "data: [DONE]", text  # whole: no silent truncation
    return worker, "".join(text)


async def test_session_keeps_its_worker_across_replicas(two_gateways):
    stack = two_gateways

    async def session(client: httpx.AsyncClient, s: int) -> set[str]:
        workers = set()
        for turn in range(4):
            url = stack.urls[turn % 2]  # alternate replicas explicitly
            body = chat_body(stack.model, f"session {s} turn {turn}: unrelated text {turn * 7919}", f"u{s}")
            r = await client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": f"s{s}"})
            assert r.status_code == 200, r.text
            workers.add(r.headers["x-duet-worker"])
        return workers

    async with httpx.AsyncClient(timeout=30) as client:
        per_session = await asyncio.gather(*(session(client, s) for s in range(4)))
    for s, workers in enumerate(per_session):
        assert len(workers) == 1, f"session s{s} moved between workers across replicas: {workers}"


async def test_gateway_killed_before_first_byte_loses_no_request(two_gateways):
    """Runs last in this module: it kills one of the module's gateways."""
    stack = two_gateways
    port = free_port()
    balancer = Balancer([parse_backend(u.removeprefix("http://")) for u in stack.urls], health_interval_s=0.2)
    server = await _serve(balancer, port)
    url = f"http://127.0.0.1:{port}"
    # a fresh connection per request, so consecutive requests alternate between the two gateways
    limits = httpx.Limits(max_keepalive_connections=0)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            prompts = [f"request {i} " + "about the deployment of replicated gateways " * 6 for i in range(4)]
            requests = [asyncio.create_task(_stream(client, url, chat_body(stack.model, p, f"u{i}", 8)))
                        for i, p in enumerate(prompts)]
            await asyncio.sleep(0.5)
            t_kill = time.monotonic()
            stack.gateways[0].proc.kill()  # like a crashed pod: no drain, connections reset
            results = await asyncio.gather(*requests, return_exceptions=True)
            assert time.monotonic() - t_kill > 0.3, "the requests finished before the kill: nothing was tested"
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, f"requests lost although none had started streaming: {failures!r}"
        assert balancer.replays >= 1, "no request was in flight on the killed gateway"
        assert not balancer.backends[0].live
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
