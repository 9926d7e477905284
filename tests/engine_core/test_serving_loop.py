"""The shared serving loop over real gRPC, with a model-free scheduler: streaming, errors mapped
to status codes, Abort, health, KV events, drain."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.contract import FinishReason
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc
from engine_core.errors import CapacityError, InvalidRequestError
from engine_core.request import EngineSpec, KvEvent, LoadStats, Request, StepOutput
from engine_core.worker import EngineParts, Worker

SPEC = EngineSpec("fake", "fake-model", "v1", 4, 64, ("n",), 256, 64, 100, "w0")


@dataclass
class Batch:
    chunks: list = field(default_factory=list)


class CountingScheduler:
    """Emits token i+1 for step i of every request (one step per token); prompt token 99 cannot fit."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.requests: dict[str, tuple[Request, list[int]]] = {}
        self.pending: list[StepOutput] = []
        self.events: list[KvEvent] = []
        self.step_s = step_s

    def validate(self, request: Request) -> None:
        if len(request.prompt_token_ids) > 50:
            raise InvalidRequestError("prompt too long")

    def add(self, request: Request) -> None:
        if request.prompt_token_ids[0] == 99:
            self.pending.append(StepOutput(request.request_id, 0, [], finish_reason=FinishReason.ERROR,
                                           error=CapacityError("never fits")))
            return
        self.requests[request.request_id] = (request, [])
        self.events.append(KvEvent("stored", (len(self.requests),)))

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def schedule(self):
        return Batch(list(self.requests)) if self.requests else None

    def process(self, batch, logits):
        import time

        time.sleep(self.step_s)
        outs = []
        for rid in batch.chunks:
            req, toks = self.requests[rid]
            toks.append(len(toks) + 1)
            done = len(toks) >= req.params.max_tokens
            for i in range(req.params.n):
                outs.append(StepOutput(rid, i, [toks[-1]], finish_reason=FinishReason.LENGTH if done else None,
                                       prompt_tokens=len(req.prompt_token_ids) if len(toks) == 1 else None))
            if done:
                del self.requests[rid]
        return outs

    def take_outputs(self):
        out, self.pending = self.pending, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def load(self) -> LoadStats:
        return LoadStats(len(self.requests), 0, len(self.requests), 64)

    def take_kv_events(self):
        out, self.events = self.events, []
        return out

    def take_started(self):
        return []


class NullRunner:
    def forward(self, chunks):
        return None


@pytest.fixture
async def worker():
    w = Worker(lambda: EngineParts(CountingScheduler(step_s=0.01), NullRunner(), SPEC), port=0, drain_timeout=5)
    port = await w.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield w, engine_pb2_grpc.EngineStub(channel), channel
    await channel.close()
    await w.shutdown()


def gen(rid: str, prompt=(1, 2, 3), **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=pb.SamplingParams(**sampling))


async def test_stream_tokens_and_info(worker):
    _, stub, channel = worker
    msgs = [m async for m in stub.Generate(gen("a", max_tokens=3, n=2))]
    by_index = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in (0, 1)}
    assert by_index == {0: [1, 2, 3], 1: [1, 2, 3]}
    assert msgs[0].prompt.prompt_tokens == 3
    assert [m.finish_reason for m in msgs[-2:]] == [pb.FINISH_REASON_LENGTH] * 2
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert (info.engine_kind, info.model_id, info.worker_id) == ("fake", "fake-model", "w0")
    health = health_pb2_grpc.HealthStub(channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service="duet.engine.v1.Engine"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("kwargs, needle", [
    ({"prompt": ()}, "empty"),
    ({"prompt": (500,)}, "vocabulary"),
    ({"temperature": -1.0}, "temperature"),
    ({"prompt": tuple(range(60))}, "too long"),
])
async def test_bad_arguments_are_invalid_argument(worker, kwargs, needle):
    _, stub, _ = worker
    prompt = kwargs.pop("prompt", (1, 2))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(gen("bad", prompt, max_tokens=2, **kwargs)):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


async def test_request_that_never_fits_is_resource_exhausted_and_others_go_on(worker):
    _, stub, _ = worker

    async def run(prompt):
        return [m async for m in stub.Generate(gen(f"r{prompt[0]}", prompt, max_tokens=4))]

    bad, good = await asyncio.gather(run((99,)), run((1,)), return_exceptions=True)
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [t for m in good for t in m.token_ids] == [1, 2, 3, 4]


async def read_all(call) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def test_abort_and_cancel_free_the_request(worker):
    _, stub, _ = worker
    call = stub.Generate(gen("long", max_tokens=10_000))
    first = await call.read()
    assert first.token_ids == [1]
    assert (await stub.Abort(pb.AbortRequest(request_id="long"))).found
    rest = await read_all(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert not (await stub.Abort(pb.AbortRequest(request_id="long"))).found

    call = stub.Generate(gen("gone", max_tokens=10_000))
    await call.read()
    call.cancel()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if (await stub.GetLoad(pb.GetLoadRequest())).num_running == 0:
            break
    load = await stub.GetLoad(pb.GetLoadRequest())
    assert load.num_running == 0 and load.kv_pages_used == 0


async def test_kv_events_stream(worker):
    _, stub, _ = worker
    watch = stub.WatchKvEvents(pb.WatchKvEventsRequest())
    await asyncio.sleep(0.1)  # let the watch subscribe
    [m async for m in stub.Generate(gen("k", max_tokens=1))]
    batch = await asyncio.wait_for(watch.read(), 5)
    assert batch.sequence >= 1 and batch.events[0].kind == pb.KvEvent.STORED
    watch.cancel()


async def test_drain_finishes_in_flight_and_refuses_new(worker):
    w, stub, _ = worker
    call = stub.Generate(gen("inflight", max_tokens=30))
    await call.read()
    drain = asyncio.create_task(w.step_loop.drain(10))
    await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(gen("late", max_tokens=2)):
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = await read_all(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert await drain


async def test_overload_is_resource_exhausted():
    w = Worker(lambda: EngineParts(CountingScheduler(step_s=0.01), NullRunner(), SPEC), port=0, max_pending=1)
    port = await w.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        first = stub.Generate(gen("first", max_tokens=10_000))
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(gen("second", max_tokens=2)):
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
    await w.shutdown()


class TimedScheduler(CountingScheduler):
    """One that budgets its steps in time (engine_paged's --max-decode-step-stretch): it is told each step's duration."""

    def __init__(self, step_s: float) -> None:
        super().__init__(step_s)
        self.observed: list[tuple[float, int, int]] = []

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        self.observed.append((seconds, prefill_tokens, decode_tokens))


async def test_a_scheduler_that_budgets_in_time_is_told_each_steps_duration():
    sched = TimedScheduler(step_s=0.02)
    w = Worker(lambda: EngineParts(sched, NullRunner(), SPEC), port=0, drain_timeout=5)
    port = await w.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = engine_pb2_grpc.EngineStub(channel)
        msgs = [m async for m in stub.Generate(gen("a", max_tokens=3))]
    finally:
        await channel.close()
        await w.shutdown()
    assert [t for m in msgs for t in m.token_ids] == [1, 2, 3]
    assert len(sched.observed) == 3  # one per step that ran the model, none for idle turns of the loop
    for seconds, prefill, decode in sched.observed:
        assert seconds >= 0.02 and (prefill, decode) == (0, 1)  # at least the step's own sleep; one sequence
