"""Timeouts that end every wait on an engine: first token, stall between tokens, and the gRPC settings.

`Timeouts` is the config (`timeouts:` in the gateway YAML, docs/operations.md). `StreamWatchdog` enforces
the two stream timeouts for every Generate call of the gateway with one task that wakes every `tick_s`
(a stream is expired at most one tick late),
so the per-token path costs one clock read and no timer: each `WatchedStream` notes when its last
message came; the watchdog expires a stream whose first message is later than `first_token_s` after the
call began, or whose next message is later than `stall_s` after the last. Expiring cancels the gRPC
call (the engine aborts the request and frees its pages as soon as it runs again: a frozen worker does
so when it thaws) and the reader gets `EngineCallError(code="DEADLINE_EXCEEDED")`: before the first
token the request is retried on another worker, after it the client gets an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.engine_client import EngineCallError, GenerateStream

log = logging.getLogger("duet.gateway.timeouts")


@dataclass(frozen=True)
class Timeouts:
    first_token_s: float | None = 120.0  # Generate call -> first message (queueing + prefill); None: no limit
    stall_s: float | None = 30.0  # between two messages of a stream; None: no limit
    request_s: float | None = 1800.0  # gRPC deadline on a whole Generate call
    rpc_s: float = 2.0  # gRPC deadline on control calls (health, load, info, abort)
    keepalive_time_s: float = 10.0  # HTTP/2 ping on an idle connection to a worker ...
    keepalive_timeout_s: float = 5.0  # ... which must answer within this, or its streams fail
    breaker_failures: int = 5  # consecutive failed calls that open a worker's circuit breaker
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


class WatchedStream:
    """A GenerateStream the watchdog may expire; otherwise it passes every message through."""

    def __init__(self, inner: GenerateStream, worker_id: str, watchdog: StreamWatchdog) -> None:
        self._inner = inner
        self._it = inner.__aiter__()
        self._watchdog = watchdog
        self.worker_id = worker_id
        self.started_at = self.last_at = watchdog.clock()
        self.got_first = False
        self.expired: str | None = None  # why the watchdog ended it

    def __aiter__(self):
        return self

    async def __anext__(self):
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
            if e.retryable:  # the worker failed; a request it refused as invalid is not its fault
                self._watchdog.report(self.worker_id, ok=False)
            raise
        except StopAsyncIteration:
            self._watchdog.forget(self)
            raise
        if self.expired is not None:
            raise self._error()
        if not self.got_first:
            self.got_first = True
            self._watchdog.report(self.worker_id, ok=True)
        self.last_at = self._watchdog.clock()
        return msg

    def _error(self) -> EngineCallError:
        return EngineCallError(self.worker_id, "DEADLINE_EXCEEDED", self.expired or "", retryable=True)

    def expire(self, reason: str) -> None:
        self.expired = reason
        self._watchdog.forget(self)
        self._inner.cancel()

    def cancel(self) -> None:
        self._watchdog.forget(self)
        self._inner.cancel()


class StreamWatchdog:
    """Expires streams past their deadlines, and tells `on_outcome(worker_id, ok, timed_out)` how each
    call went (ok: its first message came; not ok: a retryable error or a timeout) for the circuit
    breakers and the metrics."""

    def __init__(self, timeouts: Timeouts, tick_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 on_outcome: Callable[[str, bool, bool], None] | None = None) -> None:
        self.timeouts = timeouts
        self.tick_s = tick_s
        self.clock = clock
        self.on_outcome = on_outcome
        self._streams: set[WatchedStream] = set()

    def watch(self, stream: GenerateStream, worker_id: str) -> WatchedStream:
        watched = WatchedStream(stream, worker_id, self)
        self._streams.add(watched)
        return watched

    def report(self, worker_id: str, ok: bool, timed_out: bool = False) -> None:
        if self.on_outcome is not None:
            self.on_outcome(worker_id, ok, timed_out)

    def forget(self, stream: WatchedStream) -> None:
        self._streams.discard(stream)

    def __len__(self) -> int:
        return len(self._streams)

    def check(self) -> list[WatchedStream]:
        """Expire every stream past its deadline now; returns them (the loop calls this each tick)."""
        now, t, expired = self.clock(), self.timeouts, []
        for s in list(self._streams):
            if not s.got_first:
                if t.first_token_s is not None and now - s.started_at > t.first_token_s:
                    s.expire(f"no first token from worker {s.worker_id} within {t.first_token_s:g} s")
                    expired.append(s)
            elif t.stall_s is not None and now - s.last_at > t.stall_s:
                s.expire(f"worker {s.worker_id} sent no token for {t.stall_s:g} s (stream stalled)")
                expired.append(s)
        for s in expired:
            log.warning("%s", s.expired)
            self.report(s.worker_id, ok=False, timed_out=True)
        return expired

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.check()
            except Exception:  # the watchdog must outlive any one bad stream
                log.exception("stream watchdog tick failed")
