"""A fake engine worker for gateway tests: no process, no gRPC, the gateway's own EngineClient seam
(gateway/backends/engine_client.py) answered in this process.

`FakeEngine(kind)` is one worker; `engine.client` is the EngineClient the gateway's worker pool gets for its
address (tests/support/fake_gateway.py wires them). Unscripted, a Generate call is answered by
`duet engine sim`'s own servicer (duet.sim_worker.SimEngine, driven in process): the same token ids, prompt
info, cached tokens, logprobs, `n` choices, stop ids and KV events as a sim process. A test scripts the next
calls instead, one script per call, each a list of steps played in order:

    engine.script([Sim(3), Fail("UNAVAILABLE")])    # three of the sim's messages, then the call fails
    engine.script([Fail("UNAVAILABLE")])            # fails before any message: dispatch retries elsewhere
    engine.script([Started(), Tokens([5, 6]), Hang()])  # a token, then silence until the gateway cancels
    engine.script([Tokens([7], finish="stop")])     # one token that ends the choice

`engine.requests` holds every GenerateRequest it got, `engine.cancelled` how many calls the gateway
cancelled (a client that left, a stop string, a timeout), `engine.open_streams` the calls in flight.
`engine.kill()` is a crashed process: open streams fail UNAVAILABLE, every later call too, health says no.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from duet.engine_config import EngineConfig, SimConfig
from duet.model_make import default_model_dir
from duet.rpc import engine_pb2 as pb
from duet.sim_worker import SimEngine, spec_for
from gateway.backends.engine_client import EngineCallError, to_call_error

FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
          "abort": pb.FINISH_REASON_ABORT}
_PORTS = itertools.count(41_000)  # fake addresses look like a sim's (127.0.0.1:port); nothing listens there


@dataclass(frozen=True)
class Started:
    """The engine's `started` progress message (it took the request out of its queue)."""


@dataclass(frozen=True)
class Tokens:
    """One GenerateResponse: `token_ids` for choice `index`, optionally ending it (`finish`: stop, length,
    abort). The first message of a call carries the prompt info (`cached_tokens`, 0 unless given)."""

    token_ids: tuple[int, ...] | list[int] = ()
    finish: str | None = None
    index: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Sim:
    """The next `count` messages of the sim's own answer to this request (None: all of it)."""

    count: int | None = None


@dataclass(frozen=True)
class Fail:
    """The call fails here with this gRPC status (`retryable` as the real client decides it)."""

    code: str = "UNAVAILABLE"
    details: str = "fake engine: scripted failure"


@dataclass(frozen=True)
class Delay:
    seconds: float


@dataclass(frozen=True)
class Hang:
    """Nothing more, ever: the call stays open until the gateway cancels it."""


Step = Started | Tokens | Sim | Fail | Delay | Hang


class _RpcError:
    """What gateway.backends.engine_client.to_call_error reads of a grpc.aio.AioRpcError."""

    def __init__(self, code: str, details: str) -> None:
        self._code, self._details = grpc.StatusCode[code], details

    def code(self):
        return self._code

    def details(self) -> str:
        return self._details


class _Aborted(Exception):
    def __init__(self, error: EngineCallError) -> None:
        self.error = error


class _ServicerContext:
    """The servicer context SimEngine.Generate uses: abort() ends the call with a status, as in grpc.aio."""

    def __init__(self, worker_id: str, metadata: tuple) -> None:
        self._worker_id = worker_id
        self._metadata = metadata

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Aborted(to_call_error(self._worker_id, _RpcError(code.name, details)))


_END, _CANCELLED = object(), object()


class FakeStream:
    """One Generate call (gateway.backends.engine_client.GenerateStream): a task plays the script into a queue.
    After cancel() a pending or later read raises asyncio.CancelledError, as grpc.aio's does."""

    def __init__(self, engine: FakeEngine, request: pb.GenerateRequest, metadata: tuple, steps: list[Step] | None):
        self._engine = engine
        self._request = request
        self._metadata = metadata
        self._queue: asyncio.Queue = asyncio.Queue()
        self.sent = 0  # messages played so far
        self.done = False
        self._prompt_told = False  # the first token message carries the prompt info
        self._task = asyncio.get_running_loop().create_task(self._play(steps))
        engine._open.add(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        item = await self._queue.get()
        if item is _CANCELLED:
            self._queue.put_nowait(_CANCELLED)
            raise asyncio.CancelledError
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, EngineCallError):
            self._queue.put_nowait(_END)
            raise item
        return item

    def cancel(self) -> None:
        if self.done:
            return
        self._engine.cancelled += 1
        self._task.cancel()  # a sim-driven answer sees CancelledError and frees its pages, as over gRPC
        self._finish(_CANCELLED)

    def fail(self, error: EngineCallError) -> None:
        if not self.done:
            self._task.cancel()
            self._finish(error)

    def _finish(self, item) -> None:
        self.done = True
        self._engine._open.discard(self)
        self._queue.put_nowait(item)

    def _put(self, msg: pb.GenerateResponse) -> None:
        self.sent += 1
        self._prompt_told = self._prompt_told or msg.HasField("prompt")
        self._queue.put_nowait(msg)

    async def _play(self, steps: list[Step] | None) -> None:
        engine = self._engine
        sim = engine.sim.Generate(self._request, _ServicerContext(engine.worker_id, self._metadata))
        try:
            for step in steps if steps is not None else [Sim()]:
                if isinstance(step, Sim):
                    for _ in range(step.count) if step.count is not None else itertools.count():
                        try:
                            msg = await sim.__anext__()
                        except StopAsyncIteration:
                            break
                        self._put(msg)
                elif isinstance(step, Tokens):
                    msg = pb.GenerateResponse(index=step.index, token_ids=list(step.token_ids),
                                              finish_reason=FINISH[step.finish])
                    if not self._prompt_told:
                        msg.prompt.CopyFrom(pb.PromptInfo(prompt_tokens=len(self._request.prompt_token_ids),
                                                          cached_tokens=step.cached_tokens))
                    self._put(msg)
                elif isinstance(step, Started):
                    self._put(pb.GenerateResponse(started=True))
                elif isinstance(step, Fail):
                    raise _Aborted(to_call_error(engine.worker_id, _RpcError(step.code, step.details)))
                elif isinstance(step, Delay):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Hang):
                    await asyncio.Event().wait()
            if not self.done:
                self._finish(_END)
        except _Aborted as e:
            self._finish(e.error)
        finally:
            await sim.aclose()


class FakeClient:
    """The EngineClient of one FakeEngine (what gateway.backends.fleet.Fleet holds for its address)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.address = engine.address

    def _check_up(self) -> None:
        if self.engine.dead:
            raise EngineCallError(self.engine.worker_id, "UNAVAILABLE", "fake engine: killed", True)

    def generate(self, request: pb.GenerateRequest, metadata: tuple = ()) -> FakeStream:
        engine = self.engine
        engine.requests.append(request)
        steps = engine._scripts.popleft() if engine._scripts else None
        if engine.dead:
            steps = [Fail("UNAVAILABLE", "fake engine: killed")]
        return FakeStream(engine, request, metadata, steps)

    async def abort(self, request_id: str) -> bool:
        self._check_up()
        return (await self.engine.sim.Abort(pb.AbortRequest(request_id=request_id), None)).found

    async def get_info(self, timeout: float | None = None) -> pb.EngineInfo:
        self._check_up()
        return await self.engine.sim.GetInfo(pb.GetInfoRequest(), None)

    async def get_load(self, timeout: float | None = None) -> pb.EngineLoad:
        self._check_up()
        load = await self.engine.sim.GetLoad(pb.GetLoadRequest(), None)
        load.num_running = len(self.engine._open)  # scripted calls run too
        return load

    async def check_health(self, timeout: float | None = None) -> bool:
        return not self.engine.dead

    async def watch_kv_events(self) -> AsyncIterator[pb.KvEventBatch]:
        self._check_up()
        queue = self.engine.sim.cache.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            self.engine.sim.cache.unsubscribe(queue)

    async def close(self) -> None:
        pass


class FakeEngine:
    """One fake worker posing as `kind` (paged or prefix) for the tiny model; `ms_per_token` paces the sim's
    answers (0: as fast as the event loop runs), `fail_rate` makes the sim fail that share of calls before their
    first message, as `duet engine sim --sim-fail-rate` does."""

    def __init__(self, kind: str = "prefix", worker_id: str | None = None, version: str = "v1",
                 ms_per_token: float = 0.0, prefill_ms_per_token: float = 0.0, fail_rate: float = 0.0,
                 capabilities: tuple[str, ...] | None = None) -> None:
        self.address = f"127.0.0.1:{next(_PORTS)}"
        self.worker_id = worker_id or self.address
        config = SimConfig(engine=EngineConfig(model=str(default_model_dir()), port=0, worker_id=self.worker_id,
                                               version=version),
                           sim_ms_per_token=ms_per_token, sim_prefill_ms_per_token=prefill_ms_per_token,
                           sim_fail_rate=fail_rate, sim_as=kind, sim_capabilities=capabilities)
        self.sim = SimEngine(spec_for(config))
        self.kind = kind
        self.client = FakeClient(self)
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = 0
        self.dead = False
        self._open: set[FakeStream] = set()
        self._scripts: deque[list[Step]] = deque()

    def script(self, *calls: list[Step]) -> FakeEngine:
        """The next Generate calls play these scripts, one each, in order; later calls are the sim's."""
        self._scripts.extend(list(c) for c in calls)
        return self

    @property
    def open_streams(self) -> list[FakeStream]:
        return list(self._open)

    def kill(self) -> None:
        """A crashed worker: its open calls fail UNAVAILABLE now, later calls and polls too."""
        self.dead = True
        for stream in list(self._open):
            stream.fail(EngineCallError(self.worker_id, "UNAVAILABLE", "fake engine: killed", True))
