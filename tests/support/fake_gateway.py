"""The real gateway app (gateway.app.build_app) in this process in front of fake engines
(tests/support/fake_engine.py), spoken to over ASGI: no port, no worker process, no gRPC.

    async with FakeGateway([FakeEngine("prefix"), FakeEngine("paged")], limits={...}) as gw:
        r = await gw.http.post("/v1/completions", json=...)          # httpx.AsyncClient over ASGITransport
        c = await gw.openai().chat.completions.create(...)           # the openai SDK, same transport

The gateway runs its lifespan (worker polling, watchdog, ...) on the test's event loop; `start()` returns
once every engine is healthy in its pool. `**config` are the gateway YAML's sections, as in
tests/support/stack.py's `gateway_config`. httpx's ASGI transport hands over a response once it is whole,
so a client that leaves mid-answer is `request_and_leave()`, which speaks ASGI to the app itself.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai

from duet.launcher import gateway_config
from duet.model_make import default_model_dir
from gateway.app import build_app
from gateway.config import from_dict
from tests.support.fake_engine import FakeEngine

BASE_URL = "http://gateway"


class FakeGateway:
    def __init__(self, engines: list[FakeEngine] | tuple[FakeEngine, ...], **config) -> None:
        self.engines = list(engines)
        raw = gateway_config(default_model_dir(), [e.address for e in self.engines], port=8000, poll_interval_s=0.2)
        raw.update(config)
        self.config = from_dict(raw)
        by_address = {e.address: e.client for e in self.engines}
        self.app = build_app(self.config, client_factory=by_address.__getitem__)
        self.gateway = self.app.state.gateway
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE_URL, timeout=30)
        self._lifespan = None
        self._clients: list[openai.AsyncOpenAI] = []

    def engine(self, worker_id: str) -> FakeEngine:
        return next(e for e in self.engines if e.worker_id == worker_id)

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        """An openai SDK client over the same ASGI transport (closed with the gateway)."""
        client = openai.AsyncOpenAI(base_url=BASE_URL + "/v1", api_key=api_key, max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                                                  timeout=30))
        self._clients.append(client)
        return client

    async def start(self, timeout_s: float = 10.0) -> FakeGateway:
        self._lifespan = self.gateway.lifespan(self.app)
        await self._lifespan.__aenter__()
        deadline = time.monotonic() + timeout_s
        while sum(v.healthy for v in self.gateway.router.views()) < len(self.engines):
            if time.monotonic() > deadline:
                raise RuntimeError("the fake engines did not become healthy in the gateway's pool")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        for c in self._clients:
            await c.close()
        await self.http.aclose()
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
            self._lifespan = None

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def wait_for(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def request_and_leave(self, path: str, body: dict, leave_after_chunks: int = 1,
                                timeout_s: float = 10.0) -> tuple[int, list[bytes]]:
        """POST `body` as a client that disconnects once it has read `leave_after_chunks` chunks of the answer's
        body (0: as soon as an engine streams to it, before any answer). The status and the chunks it read;
        returns once the app has finished handling the request."""
        left = asyncio.Event()
        status, chunks = 0, []
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if 0 < leave_after_chunks <= len(chunks):
                    left.set()

        async def leave_once_streaming() -> None:
            while not any(s.sent > 1 for e in self.engines for s in e.open_streams):  # started + a token
                await asyncio.sleep(0.01)
            left.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"gateway"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 40000), "server": ("gateway", 80)}
        watcher = asyncio.create_task(leave_once_streaming()) if leave_after_chunks == 0 else None
        try:
            await asyncio.wait_for(self.app(scope, receive, send), timeout_s)
        finally:
            if watcher is not None:
                watcher.cancel()
        return status, chunks
