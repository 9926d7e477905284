"""How gateway/backends/http_backend.py's client fails: a backend that stalls mid-stream or on a poll, or refuses
the connection, is a retryable UNAVAILABLE within its timeout (what the circuit breaker and the health check
read), and the client closes without leaving a session open."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
import warnings

import pytest
from aiohttp import web

from duet.rpc import engine_pb2 as pb
from gateway.backends.backend_spec import BackendSpec
from gateway.backends.engine_client import EngineCallError
from gateway.backends.http_backend import HttpBackendClient
from tests.support.backend_stub import stub_backend


def _request() -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
    req.sampling.max_tokens = 8
    return req


async def _stall(request: web.Request) -> web.StreamResponse:
    """One token, then nothing: a backend hung mid-answer (or, for a GET, before any answer)."""
    if request.method == "GET":
        await asyncio.sleep(30)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = {"choices": [{"index": 0, "token_ids": [7], "finish_reason": None}]}
    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await asyncio.sleep(30)
    return resp


def test_a_backend_stalled_mid_stream_fails_the_stream_after_the_request_timeout():
    async def run() -> tuple[list[int], EngineCallError, float]:
        async with stub_backend(_stall) as url:
            client = HttpBackendClient(BackendSpec(engine="vllm", url=url, kind="paged"), {}, 16,
                                       request_timeout_s=0.5)
            got: list[int] = []
            start = time.monotonic()
            try:
                async for msg in client.generate(_request()):
                    got += msg.token_ids
            except EngineCallError as e:
                return got, e, time.monotonic() - start
            finally:
                await client.close()
            raise AssertionError("the stalled stream ended without an error")

    got, err, took = asyncio.run(run())
    assert got == [7]  # what came before the stall reached the reader
    assert (err.code, err.retryable) == ("UNAVAILABLE", True)
    assert "timeout" in err.details.lower(), err.details
    assert 0.4 < took < 10


def test_a_stalled_poll_and_a_refused_connection_are_unavailable():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]

    async def run() -> None:
        async with stub_backend(_stall) as url:
            client = HttpBackendClient(BackendSpec(engine="vllm", url=url, kind="paged"), {}, 16)
            start = time.monotonic()
            with pytest.raises(EngineCallError) as e:
                await client.get_load(timeout=0.3)
            assert (e.value.code, e.value.retryable) == ("UNAVAILABLE", True)
            assert time.monotonic() - start < 10
            assert not await client.check_health(timeout=0.3)
            await client.close()
        refused = HttpBackendClient(BackendSpec(engine="vllm", url=f"http://127.0.0.1:{closed_port}", kind="paged"),
                                    {}, 16)
        with pytest.raises(EngineCallError) as e:
            async for _ in refused.generate(_request()):
                pass
        assert (e.value.code, e.value.retryable) == ("UNAVAILABLE", True)
        assert "connect" in e.value.details.lower(), e.value.details
        await refused.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(run())
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)]


def test_reads_after_a_failed_or_cancelled_stream_fail_again_instead_of_waiting():
    """A caller that reads once more after the error (or after cancel()) gets it again at once: a stream's end is
    final, as a cancelled gRPC call's is, and no read can hang on a stream that will never send."""
    async def run() -> None:
        async with stub_backend(_stall) as url:
            spec = BackendSpec(engine="vllm", url=url, kind="paged")
            timing_out = HttpBackendClient(spec, {}, 16, request_timeout_s=2.0)  # a margin for the first token
            failed = timing_out.generate(_request())
            assert (await anext(failed)).token_ids == [7]
            for _ in range(2):
                with pytest.raises(EngineCallError) as e:
                    await asyncio.wait_for(anext(failed), 20)
                assert e.value.code == "UNAVAILABLE"
            await timing_out.close()
            patient = HttpBackendClient(spec, {}, 16)  # no timeout: only the cancel ends this stream
            cancelled = patient.generate(_request())
            assert (await anext(cancelled)).token_ids == [7]
            cancelled.cancel()
            for _ in range(2):
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(anext(cancelled), 20)
            await patient.close()

    asyncio.run(run())
