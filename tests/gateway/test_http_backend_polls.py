"""What gateway/backends/http_backend.py costs a backend per poll and per request: a stream read to its end leaves
its connection for the next request, /metrics is asked for the series the load reads, and /health is asked
every `health_every_s` while the backend answers, at once after a stream failed."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from duet.rpc import engine_pb2 as pb
from gateway.backends.backend_load import NAMES
from gateway.backends.backend_spec import BackendSpec
from gateway.backends.engine_client import EngineCallError
from gateway.backends.http_backend import HttpBackendClient
from tests.support.backend_stub import stub_backend


def _request(i: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3])
    req.sampling.max_tokens = 3
    return req


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streams_read_to_their_end_reuse_one_connection():
    peers: list[int] = []  # the client port of each request the server saw

    async def generate(request):
        peers.append(request.scope["client"][1])
        await request.body()

        async def body():
            for i in range(3):
                chunk = {"choices": [{"index": 0, "token_ids": [10 + i], "finish_reason": "length" if i == 2 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def run() -> list[list[int]]:
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/inference/v1/generate", generate,
                                                                       methods=["POST"])]),
                                               host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        client = HttpBackendClient(BackendSpec(engine="vllm", url=f"http://127.0.0.1:{port}", kind="paged"), {}, 16)
        try:
            return [[t for m in [msg async for msg in client.stream_messages(_request(i))] for t in m.token_ids]
                    for i in range(5)]
        finally:
            await client.close()
            server.should_exit = True
            await task

    answers = asyncio.run(run())
    assert answers == [[10, 11, 12]] * 5
    # five requests over one TCP connection (a stream closed before its body's end closes its connection: five)
    assert len(peers) == 5 and len(set(peers)) == 1, peers


def test_health_is_asked_every_health_every_s_while_the_backend_answers_and_at_once_after_a_failed_stream():
    asked: list[str] = []
    fail = {"generate": False}

    async def handler(request: web.Request) -> web.Response:
        asked.append(request.path)
        if request.path == "/metrics":
            names = request.query.getall("name[]", [])
            assert sorted(names) == sorted(NAMES["vllm"].values())  # only the series the load reads
            return web.Response(text="vllm:num_requests_running 2\n")
        if request.path == "/inference/v1/generate":
            return web.Response(status=500 if fail["generate"] else 200, text="data: [DONE]\n\n")
        return web.Response()

    async def run() -> None:
        async with stub_backend(handler) as url:
            await check(HttpBackendClient(BackendSpec(engine="vllm", url=url, kind="paged"), {}, 16,
                                          health_every_s=10.0))

    async def check(client: HttpBackendClient) -> None:

        async def poll() -> None:  # what gateway/backends/fleet.py does each poll
            if await client.check_health():
                assert (await client.get_load()).num_running == 2

        for _ in range(3):
            await poll()
        assert asked == ["/health", "/metrics", "/metrics", "/metrics"]  # /metrics answering: no more /health
        asked.clear()
        fail["generate"] = True
        with pytest.raises(EngineCallError, match="HTTP 500"):
            async for _ in client.generate(_request(1)):  # the stream the gateway reads
                pass
        await poll()
        assert asked[-2:] == ["/health", "/metrics"]  # a failed stream: the next poll asks /health again
        client._health_at -= 11.0  # ten seconds on, /health is asked again though /metrics kept answering
        asked.clear()
        await poll()
        assert asked == ["/health", "/metrics"]
        await client.close()

    asyncio.run(run())


def test_a_quiet_backend_is_polled_every_idle_poll_s_and_every_poll_while_it_has_work():
    asked: list[str] = []
    running = {"n": 0}
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        asked.append(request.path)
        if request.path == "/metrics":
            return web.Response(text=f"vllm:num_requests_running {running['n']}\n")
        if request.path == "/inference/v1/generate":
            await release.wait()
            return web.Response(text="data: [DONE]\n\n")
        return web.Response()

    async def run() -> None:
        async with stub_backend(handler) as url:
            await check(HttpBackendClient(BackendSpec(engine="vllm", url=url, kind="paged"), {}, 16, idle_poll_s=5.0))

    async def check(client: HttpBackendClient) -> None:

        async def poll() -> int:  # what gateway/backends/fleet.py does each poll
            assert await client.check_health()
            return (await client.get_load()).num_running

        assert await poll() == 0
        assert asked == ["/health", "/metrics"]
        asked.clear()
        for _ in range(3):
            assert await poll() == 0
        assert asked == []  # idle, nothing sent since: the last poll's answer stands
        client._polled_at -= 5.5  # five seconds on, it is asked again
        assert await poll() == 0
        assert asked == ["/metrics"]
        asked.clear()
        stream = client.generate(_request(1))  # a stream in flight: every poll asks, for the watchdog's progress
        await asyncio.sleep(0)
        running["n"] = 1
        for _ in range(2):
            assert await poll() == 1
        assert asked.count("/metrics") == 2
        release.set()
        async for _ in stream:
            pass
        asked.clear()
        running["n"] = 0
        assert await poll() == 0  # the first poll after the stream: its counters moved
        assert await poll() == 0
        assert asked == ["/metrics"]
        asked.clear()
        running["n"] = 2  # work another client sent, seen when the idle interval is up
        client._polled_at -= 5.5
        assert await poll() == 2
        assert await poll() == 2  # busy: asked every poll
        assert asked == ["/metrics", "/metrics"]
        await client.close()

    asyncio.run(run())


def test_a_cancelled_stream_closes_its_backend_request():
    # a client gone mid-answer: the backend must see its request closed (and stop generating), not stream on
    sent: list[int] = []
    closed: list[str] = []  # what the backend's handler saw end it

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(500):  # 10 s of tokens: far past the test's end unless the request is closed
                chunk = {"choices": [{"index": 0, "token_ids": [i], "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                sent.append(i)
                await asyncio.sleep(0.02)
        except (ConnectionResetError, asyncio.CancelledError) as e:
            closed.append(type(e).__name__)
            raise
        return resp

    async def run() -> None:
        async with stub_backend(handler) as url:
            client = HttpBackendClient(BackendSpec(engine="vllm", url=url, kind="paged"), {}, 16)
            request = _request(1)
            request.sampling.max_tokens = 500
            stream = client.generate(request)
            assert [t for _ in range(2) for t in (await stream.__anext__()).token_ids] == [0, 1]
            stream.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stream.__anext__()
            for _ in range(200):  # up to 10 s for the backend to see its request closed
                if closed:
                    break
                await asyncio.sleep(0.05)
            assert closed, "the backend's request stayed open after the stream was cancelled"
            assert client.streams_open == 0
            await client.close()
        assert len(sent) < 100

    asyncio.run(run())
