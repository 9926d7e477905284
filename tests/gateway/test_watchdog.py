"""The stream watchdog tells a queued request from a stalled engine (issue 21), on a fake clock and
fake streams: what it ends, when, and what it blames the worker for."""

from __future__ import annotations

import asyncio
import math

import pytest

from duet.rpc import engine_pb2 as pb
from gateway import errors
from gateway.backends.engine_client import EngineCallError
from gateway.serving.timeouts import (
    DEADLINE,
    ERROR,
    FIRST_TOKEN,
    OK,
    STALL,
    ClientDeadline,
    StreamWatchdog,
    Timeouts,
    client_timeout_s,
)
from gateway.ticks import tick_wait

T = Timeouts(first_token_s=5.0, stall_s=2.0)


class FakeStream:
    """A Generate call whose messages the test pushes; cancel() ends it as grpc.aio does."""

    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True
        self.q.put_nowait(asyncio.CancelledError())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def rig():
    clock, outcomes, progress = Clock(), [], {}
    dog = StreamWatchdog(T, clock=clock, on_outcome=lambda w, o: outcomes.append((w, o)),
                         progress_at=lambda w: progress.get(w, -math.inf))
    return dog, clock, outcomes, progress


async def _next(watched):
    return await asyncio.wait_for(watched.__anext__(), 1.0)


async def _settle() -> None:
    for _ in range(5):  # let a reader task take what was pushed
        await asyncio.sleep(0)


async def test_a_queued_request_on_a_progressing_worker_waits_without_blame(rig):
    dog, clock, outcomes, progress = rig
    inner = FakeStream()
    watched = dog.watch(inner, "w")
    for t in range(1, 60):  # a minute in the queue, far past both timeouts; the worker keeps stepping
        clock.now = float(t)
        progress["w"] = clock.now
        assert dog.check() == []
    assert not inner.cancelled
    inner.q.put_nowait(pb.GenerateResponse(started=True))
    inner.q.put_nowait(pb.GenerateResponse(token_ids=[7]))
    msg = await _next(watched)  # `started` is consumed: the reader sees the first token
    assert list(msg.token_ids) == [7]
    assert outcomes == [("w", OK)]


async def test_the_first_token_deadline_runs_from_the_engine_s_start_and_blames_no_one(rig):
    dog, clock, outcomes, progress = rig
    inner = FakeStream()
    watched = dog.watch(inner, "w")
    clock.now = 30.0  # queued for 30 s
    inner.q.put_nowait(pb.GenerateResponse(started=True))
    reader = asyncio.ensure_future(_next(watched))
    await _settle()
    assert watched.started_at == 30.0
    for t in (31.0, 34.0, 35.0):  # within first_token_s of the start
        clock.now = progress["w"] = t
        assert dog.check() == []
    clock.now = progress["w"] = 35.5
    assert dog.check() == [watched]
    with pytest.raises(EngineCallError) as e:
        await reader
    assert e.value.retryable and "no first token" in e.value.details
    assert outcomes == [("w", FIRST_TOKEN)]  # a timeout, not a breaker failure (the app counts only ERROR/STALL)


async def test_a_frozen_worker_ends_its_queued_and_streaming_requests_as_stalled(rig):
    dog, clock, outcomes, progress = rig
    streaming, queued = FakeStream(), FakeStream()
    a, b = dog.watch(streaming, "w"), dog.watch(queued, "w")
    streaming.q.put_nowait(pb.GenerateResponse(token_ids=[1]))
    await _next(a)
    progress["w"] = 0.0  # the last poll that saw its steps advance; then it froze
    clock.now = 1.9
    assert dog.check() == []
    clock.now = 2.1
    assert set(dog.check()) == {a, b}
    assert "stream stalled" in a.expired and "made no progress" in b.expired
    assert outcomes == [("w", OK), ("w", STALL), ("w", STALL)]


async def test_a_silent_stream_on_a_busy_worker_is_not_a_stall(rig):
    dog, clock, outcomes, _ = rig
    preempted, other = FakeStream(), FakeStream()
    a, b = dog.watch(preempted, "w"), dog.watch(other, "w")
    for s, w in ((preempted, a), (other, b)):
        s.q.put_nowait(pb.GenerateResponse(token_ids=[1]))
        await _next(w)
    for t in range(1, 20):  # `a` is silent (preempted, say) while the worker streams `b`'s tokens
        clock.now = float(t)
        other.q.put_nowait(pb.GenerateResponse(token_ids=[t]))
        await _next(b)
        assert dog.check() == []
    assert outcomes == [("w", OK), ("w", OK)]


async def test_the_client_deadline_ends_the_request_without_blaming_the_worker(rig):
    dog, clock, outcomes, progress = rig
    inner = FakeStream()
    watched = dog.watch(inner, "w", deadline=3.0)
    reader = asyncio.ensure_future(_next(watched))
    await _settle()
    clock.now = progress["w"] = 3.5
    assert dog.check() == [watched] and watched.expired_kind == DEADLINE
    with pytest.raises(ClientDeadline):
        await reader
    assert inner.cancelled and outcomes == []


async def test_a_worker_refusing_for_load_is_not_blamed(rig):
    dog, _, outcomes, _ = rig
    full, broken = FakeStream(), FakeStream()
    a, b = dog.watch(full, "full"), dog.watch(broken, "broken")
    full.q.put_nowait(EngineCallError("full", "RESOURCE_EXHAUSTED", "64 requests in flight", True))
    broken.q.put_nowait(EngineCallError("broken", "UNAVAILABLE", "gone", True))
    for w in (a, b):
        with pytest.raises(EngineCallError):
            await _next(w)
    assert outcomes == [("broken", ERROR)]


def test_the_client_s_timeout_comes_from_the_sdk_header_or_the_body():
    assert client_timeout_s({"x-stainless-read-timeout": "600.0"}, {}) == 600.0  # the python SDK's default
    assert client_timeout_s({"x-stainless-timeout": "30"}, {"timeout": 5}) == 30.0  # the header wins
    assert client_timeout_s({}, {"timeout": 2.5}) == 2.5
    assert client_timeout_s({}, {"model": "m"}) is None
    for bad in ("0", "-1", "inf"):
        with pytest.raises(errors.InvalidRequest) as e:
            client_timeout_s({"x-stainless-timeout": bad}, {})
        assert e.value.param == "timeout" and e.value.status == 400
    # a header that is no number is an SDK's "none" (the anthropic SDK streams with "NOT_GIVEN")
    assert client_timeout_s({"x-stainless-timeout": "NOT_GIVEN"}, {}) is None
    for bad in ("soon", 0, -1):  # the body field is the client's own words: checked strictly
        with pytest.raises(errors.InvalidRequest) as e:
            client_timeout_s({}, {"timeout": bad})
        assert e.value.param == "timeout" and e.value.status == 400


async def test_the_watchdog_ticks_only_while_it_watches_a_stream():
    # its real loop, a short tick: with no stream it sleeps (no check at all), a stream wakes it and is expired
    # on time, and once the stream is gone it sleeps again (an idle gateway's wake-ups were its CPU)
    clock = Clock()
    dog = StreamWatchdog(Timeouts(first_token_s=None, stall_s=None), tick_s=0.01, clock=clock)
    checks = []
    check = dog.check
    dog.check = lambda: checks.append(1) or check()
    task = asyncio.ensure_future(dog.run())
    try:
        await asyncio.sleep(0.2)  # twenty ticks' time
        assert checks == []
        inner = FakeStream()
        watched = dog.watch(inner, "w", deadline=5.0)
        clock.now = 6.0
        with pytest.raises(ClientDeadline):
            await _next(watched)
        assert inner.cancelled and checks
        await asyncio.sleep(0.05)
        n = len(checks)
        await asyncio.sleep(0.2)
        assert len(checks) <= n + 1  # the tick in flight when the stream went, then none
    finally:
        task.cancel()


async def test_without_a_client_deadline_the_watchdog_ticks_once_a_second_with_the_other_periodic_tasks():
    # the stall and first-token limits are tens of seconds: a quarter-second tick was three wake-ups a second more
    # than the gateway's other loops (gateway/ticks.py), each a cold wake of the process
    dog = StreamWatchdog(T, tick_s=0.05)
    wakes = []
    dog.check = lambda: wakes.append(asyncio.get_running_loop().time()) or []
    task = asyncio.ensure_future(dog.run())
    try:
        dog.watch(FakeStream(), "w")
        await asyncio.sleep(2.2)
        assert 1 <= len(wakes) <= 3  # 0.05 s ticks would be 44
        assert dog.tick() == 1.0  # the coarse tick, on whole seconds (gateway/ticks.py, tested there)
    finally:
        task.cancel()


async def test_a_client_deadline_watched_during_a_coarse_tick_still_expires_on_time():
    clock = Clock()
    dog = StreamWatchdog(Timeouts(first_token_s=None, stall_s=None), tick_s=0.05, clock=clock)
    task = asyncio.ensure_future(dog.run())
    try:
        dog.watch(FakeStream(), "a")  # no deadline: the watchdog naps until the next whole second
        await asyncio.sleep(tick_wait(1.0) + 0.05)  # just past a whole second: the coarse nap has ~0.95 s left
        inner = FakeStream()
        watched = dog.watch(inner, "b", deadline=1.0)
        assert dog.tick() == 0.05
        clock.now = 2.0  # past it: the next fine tick expires it, long before the coarse one
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ClientDeadline):
            await _next(watched)
        assert inner.cancelled and loop.time() - t0 < 0.5  # the coarse nap would end ~0.95 s on
    finally:
        task.cancel()
