"""The gateway's one seam to an engine worker.

`EngineClient` is the small interface the rest of the gateway uses; `GrpcEngineClient` implements it
over grpc.aio and the proto (duet/rpc). gRPC failures surface as `EngineCallError`, whose
`retryable` says whether another worker may succeed (unavailable, internal...) or the request itself
is bad (invalid argument -> the client gets a 400).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc

_NOT_RETRYABLE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED})


class EngineCallError(Exception):
    """A call to a worker failed; `code` is the gRPC status name."""

    def __init__(self, worker_id: str, code: str, details: str, retryable: bool) -> None:
        super().__init__(f"worker {worker_id}: {code}: {details}")
        self.worker_id = worker_id
        self.code = code
        self.details = details
        self.retryable = retryable

    @property
    def busy(self) -> bool:
        """The worker refused for load (full, too many in flight): not its fault, and not retried elsewhere
        (gateway/serving/dispatch.py): a busy worker means a loaded pool, and a retry would add to it."""
        return self.code == "RESOURCE_EXHAUSTED"


class GenerateStream(Protocol):
    """One Generate call: iterate it for responses; `cancel()` tells the engine to abort."""

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    address: str

    def generate(self, request: pb.GenerateRequest, metadata: tuple = ()) -> GenerateStream: ...

    async def abort(self, request_id: str) -> bool: ...

    async def get_info(self, timeout: float | None = None) -> pb.EngineInfo: ...

    async def get_load(self, timeout: float | None = None) -> pb.EngineLoad: ...

    async def check_health(self, timeout: float | None = None) -> bool: ...

    def watch_kv_events(self) -> AsyncIterator[pb.KvEventBatch]: ...

    async def close(self) -> None: ...


def to_call_error(worker_id: str, err: grpc.aio.AioRpcError) -> EngineCallError:
    code = err.code()
    return EngineCallError(worker_id, code.name, err.details() or "", code not in _NOT_RETRYABLE)


class _GrpcStream:
    """A grpc.aio stream call as an async iterator whose errors are EngineCallError. It reads the call
    directly (`read()`), skipping grpc's own async-generator layer: this is the per-token path."""

    def __init__(self, worker_id: str, call) -> None:
        self._worker_id = worker_id
        self._call = call

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise to_call_error(self._worker_id, err) from None
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        return msg

    def cancel(self) -> None:
        if not self._call.done():  # cancelling a finished call still costs a C-core round trip
            self._call.cancel()


class GrpcEngineClient:
    """EngineClient over one grpc.aio channel (HTTP/2 multiplexes every stream on it)."""

    def __init__(self, address: str, worker_id: str | None = None, keepalive_time_s: float = 10.0,
                 keepalive_timeout_s: float = 5.0, request_timeout_s: float | None = None,
                 rpc_timeout_s: float = 2.0) -> None:
        self.address = address
        self.worker_id = worker_id or address
        self.rpc_timeout_s = rpc_timeout_s  # the deadline of control calls (health, load, info, abort)
        self.request_timeout_s = request_timeout_s  # the gRPC deadline of a whole Generate call
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
                     ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
                     ("grpc.http2.max_pings_without_data", 0), ("grpc.enable_retries", 0)],
        )
        self._stub = pb_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, request: pb.GenerateRequest, metadata: tuple = ()) -> GenerateStream:
        call = self._stub.Generate(request, metadata=metadata or None, timeout=self.request_timeout_s)
        return _GrpcStream(self.worker_id, call)

    async def abort(self, request_id: str) -> bool:
        try:
            return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.rpc_timeout_s)).found
        except grpc.aio.AioRpcError:
            return False

    async def get_info(self, timeout: float | None = None) -> pb.EngineInfo:
        try:
            return await self._stub.GetInfo(pb.GetInfoRequest(), timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise to_call_error(self.worker_id, err) from None

    async def get_load(self, timeout: float | None = None) -> pb.EngineLoad:
        try:
            return await self._stub.GetLoad(pb.GetLoadRequest(), timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise to_call_error(self.worker_id, err) from None

    async def check_health(self, timeout: float | None = None) -> bool:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                            timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def watch_kv_events(self) -> AsyncIterator[pb.KvEventBatch]:
        call = self._stub.WatchKvEvents(pb.WatchKvEventsRequest())
        try:
            async for batch in call:
                yield batch
        except grpc.aio.AioRpcError as err:
            raise to_call_error(self.worker_id, err) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close(grace=None)
