"""Timeouts that end every wait on an engine, told apart by what the engine is doing.

`Timeouts` is the config (`timeouts:` in the gateway YAML, docs/operations.md). `StreamWatchdog` enforces
them for every Generate call of the gateway with one task that wakes once a second while it watches a stream, with
the gateway's other periodic tasks (gateway/ticks.py), and every `tick_s` (0.25 s) while one of them carries a
client deadline; a stream is expired at most one tick late; with none it sleeps until one comes (a loop's wake-ups
are most of an idle gateway's CPU). The per-token path costs one clock read and no timer. A stream is
in one of three phases, and each has its own rule:

    queued     sent, the engine has not started it: no deadline of its own. Waiting behind other
               work on a healthy engine is not a fault (admission control keeps the wait bounded,
               gateway/serving/admission.py)
    started    the engine took it out of its queue (its `started` progress message): the first
               token must come within `first_token_s` (that is its own prefill)
    streaming  tokens flowing

In every phase the stream ends as STALLED when it has been silent for `stall_s` AND its worker made
no progress for `stall_s`: no message on any of its streams and no advance of its step counter
(`progress_at`, from the fleet's GetLoad polls). A frozen worker (SIGSTOP) stops both, so its
streams end within `stall_s` of the freeze; a busy one keeps stepping, so its queued streams wait.
A client deadline (`deadline`, from the request's `timeout`: `client_timeout_s`) ends the stream in
any phase.

Expiring cancels the gRPC call (the engine aborts the request and frees its pages as soon as it runs
again: a frozen worker does so when it thaws). The reader gets `EngineCallError(code="DEADLINE_EXCEEDED")`
(`ClientDeadline` for the client's own deadline): before the first token a stall or a first-token
timeout is retried on another worker, the client's deadline is not; after it the client gets an error.

`on_outcome(worker_id, outcome)` feeds the circuit breakers and the metrics: OK (first token came),
ERROR (a retryable call failure, not RESOURCE_EXHAUSTED: a full worker is busy, not broken), STALL,
FIRST_TOKEN (a slow prefill: a timeout, but the worker was progressing, so no breaker failure).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.backends.engine_client import EngineCallError, GenerateStream
from gateway.errors import InvalidRequest
from gateway.ticks import tick_wait

log = logging.getLogger("duet.gateway.timeouts")

OK, ERROR, STALL, FIRST_TOKEN, DEADLINE = "ok", "error", "stall", "first_token", "deadline"
COARSE_TICK_S = 1.0  # the watchdog's tick while no watched stream carries a client deadline (module doc)


@dataclass(frozen=True)
class Timeouts:
    first_token_s: float | None = 120.0  # engine started the request -> first token (its prefill); None: no limit
    stall_s: float | None = 30.0  # silent stream on a worker making no progress for this long; None: no limit
    request_s: float | None = 1800.0  # gRPC deadline on a whole Generate call
    rpc_s: float = 2.0  # gRPC deadline on control calls (health, load, info, abort)
    keepalive_time_s: float = 10.0  # HTTP/2 ping on an idle connection to a worker ...
    keepalive_timeout_s: float = 5.0  # ... which must answer within this, or its streams fail
    breaker_failures: int = 5  # consecutive failed calls (errors, stalls) that open a worker's circuit breaker
    breaker_open_s: float = 10.0  # how long an open breaker keeps the worker out of routing

    def validate(self) -> Timeouts:
        for name in ("first_token_s", "stall_s", "request_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"timeouts.{name} must be > 0 (or null for no limit), got {value}")
        for name in ("rpc_s", "keepalive_time_s", "keepalive_timeout_s", "breaker_open_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"timeouts.{name} must be > 0, got {getattr(self, name)}")
        if self.breaker_failures < 1:
            raise ValueError(f"timeouts.breaker_failures must be >= 1, got {self.breaker_failures}")
        return self


# what the OpenAI SDKs send as the request's timeout, in seconds (the python SDK: its read timeout)
TIMEOUT_HEADERS = ("x-stainless-timeout", "x-stainless-read-timeout")


def client_timeout_s(headers, body) -> float | None:
    """The client's timeout for this request: the SDK's header, else a body field `timeout` (seconds).
    Raises InvalidRequest (400, param "timeout") for a value that is not a positive number."""
    # an SDK header that is not a number says there is none: the anthropic SDK sends "NOT_GIVEN" when streaming
    values = [v for h in TIMEOUT_HEADERS if _is_number(v := headers.get(h))]
    if isinstance(body, dict):
        values.append(body.get("timeout"))
    for value in values:
        if value is None or isinstance(value, bool):
            continue
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise InvalidRequest(f"timeout must be a number of seconds, got {value!r}", "timeout") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise InvalidRequest(f"timeout must be > 0 seconds, got {value!r}", "timeout")
        return seconds
    return None


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


class ClientDeadline(EngineCallError):
    """The client's own timeout passed: the request ends (no retry), and no worker is at fault."""


class WatchedStream:
    """A GenerateStream the watchdog may expire; passes every token message through and consumes the
    engine's `started` progress messages (noting when the engine started the request)."""

    def __init__(self, inner: GenerateStream, worker_id: str, watchdog: StreamWatchdog,
                 deadline: float | None = None) -> None:
        self._inner = inner
        self._it = inner.__aiter__()
        self._watchdog = watchdog
        self.worker_id = worker_id
        self.deadline = deadline  # watchdog clock; None: the client set no timeout
        self.opened_at = self.last_at = watchdog.clock()
        self.started_at: float | None = None  # the engine's `started`: its queue wait ended
        self.heard_at: float | None = None  # the last message of any kind from the engine
        self.got_first = False
        self.expired: str | None = None  # why the watchdog ended it
        self.expired_kind: str | None = None  # STALL, FIRST_TOKEN or DEADLINE

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            try:
                msg = await self._it.__anext__()
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError from a call cancelled locally; when the watchdog did it
                # (and the task itself is not being cancelled) that is a timeout, not a cancellation
                task = asyncio.current_task()
                if self.expired is None or (task is not None and task.cancelling()):
                    raise
                raise self._error() from None
            except EngineCallError as e:
                self._watchdog.forget(self)
                # the worker failed; a request it refused as invalid, or for load, is not its fault
                if e.retryable and not e.busy:
                    self._watchdog.report(self.worker_id, ERROR)
                raise
            except StopAsyncIteration:
                self._watchdog.forget(self)
                raise
            if self.expired is not None:
                raise self._error()
            self.heard_at = self.last_at = self._watchdog.clock()
            if msg.started:
                self.started_at = self.heard_at
                continue
            if not self.got_first:
                self.got_first = True
                self._watchdog.report(self.worker_id, OK)
            return msg

    def _error(self) -> EngineCallError:
        if self.expired_kind == DEADLINE:
            return ClientDeadline(self.worker_id, "DEADLINE_EXCEEDED", self.expired or "", retryable=False)
        return EngineCallError(self.worker_id, "DEADLINE_EXCEEDED", self.expired or "", retryable=True)

    def expire(self, kind: str, reason: str) -> None:
        self.expired_kind, self.expired = kind, reason
        self._watchdog.forget(self)
        self._inner.cancel()

    def cancel(self) -> None:
        self._watchdog.forget(self)
        self._inner.cancel()


class StreamWatchdog:
    """Expires streams past their deadlines (module doc); `progress_at(worker_id)` is when the worker
    last showed progress (its step counter advanced, or it had no work), on this watchdog's clock."""

    def __init__(self, timeouts: Timeouts, tick_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 on_outcome: Callable[[str, str], None] | None = None,
                 progress_at: Callable[[str], float] | None = None) -> None:
        self.timeouts = timeouts
        self.tick_s = tick_s
        self.clock = clock
        self.on_outcome = on_outcome
        self.progress_at = progress_at or (lambda worker_id: -math.inf)
        self._streams: set[WatchedStream] = set()
        self._heard: dict[str, float] = {}  # worker id -> last message on any of its streams
        self._watching = asyncio.Event()  # set while there are streams to tick for (`run`)
        self._nap: asyncio.Future | None = None  # `run`'s sleep between ticks, woken early by a client deadline

    def watch(self, stream: GenerateStream, worker_id: str, deadline: float | None = None) -> WatchedStream:
        watched = WatchedStream(stream, worker_id, self, deadline)
        self._streams.add(watched)
        if not self._watching.is_set():
            self._watching.set()
        if deadline is not None and self._nap is not None:
            _wake(self._nap)  # `run` may be on the coarse tick: it takes the fine one from now on
        return watched

    def report(self, worker_id: str, outcome: str) -> None:
        if self.on_outcome is not None:
            self.on_outcome(worker_id, outcome)

    def forget(self, stream: WatchedStream) -> None:
        if stream.heard_at is not None and stream.heard_at > self._heard.get(stream.worker_id, -math.inf):
            self._heard[stream.worker_id] = stream.heard_at
        self._streams.discard(stream)

    def __len__(self) -> int:
        return len(self._streams)

    def worker_active_at(self, worker_id: str) -> float:
        """The last sign of life of the worker: a message on one of its streams, or a step advance."""
        return max(self._heard.get(worker_id, -math.inf), self.progress_at(worker_id))

    def check(self) -> list[WatchedStream]:
        """Expire every stream past its deadline now; returns them (the loop calls this each tick)."""
        now, t, expired = self.clock(), self.timeouts, []
        for s in self._streams:
            if s.heard_at is not None and s.heard_at > self._heard.get(s.worker_id, -math.inf):
                self._heard[s.worker_id] = s.heard_at
        for s in list(self._streams):
            if s.deadline is not None and now > s.deadline:
                s.expire(DEADLINE, f"the client's timeout passed after {now - s.opened_at:.1f} s on worker "
                                   f"{s.worker_id}")
            elif (not s.got_first and s.started_at is not None and t.first_token_s is not None
                  and now - s.started_at > t.first_token_s):
                s.expire(FIRST_TOKEN, f"no first token from worker {s.worker_id} within {t.first_token_s:g} s "
                                      f"of starting the request")
            elif (t.stall_s is not None and now - s.last_at > t.stall_s
                  and now - self.worker_active_at(s.worker_id) > t.stall_s):
                if s.got_first:
                    s.expire(STALL, f"worker {s.worker_id} sent no token for {t.stall_s:g} s (stream stalled)")
                else:
                    s.expire(STALL, f"worker {s.worker_id} made no progress for {t.stall_s:g} s (stalled) "
                                    f"before the first token")
            else:
                continue
            expired.append(s)
        for s in expired:
            log.warning("%s", s.expired)
            if s.expired_kind != DEADLINE:
                self.report(s.worker_id, s.expired_kind)
        return expired

    def tick(self) -> float:
        """The seconds between checks now: `tick_s` while a watched stream carries a client deadline, else
        COARSE_TICK_S (the stall and first-token limits are tens of seconds; module doc)."""
        return self.tick_s if any(s.deadline is not None for s in self._streams) else COARSE_TICK_S

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._streams:  # nothing to expire: sleep until `watch` has a stream (module doc)
                self._watching.clear()
                await self._watching.wait()
            self._nap = loop.create_future()
            timer = loop.call_later(tick_wait(self.tick()), _wake, self._nap)
            try:
                await self._nap
            finally:
                timer.cancel()
            try:
                self.check()
            except Exception:  # the watchdog must outlive any one bad stream
                log.exception("stream watchdog tick failed")


def _wake(nap: asyncio.Future) -> None:
    if not nap.done():
        nap.set_result(None)
