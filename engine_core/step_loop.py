"""The serving loop shared by every engine: a dedicated thread steps the model, the asyncio
event loop (grpc.aio) only queues work and streams results, so it never blocks on the model.

    event loop                               step thread
    ----------                               -----------
    generate(req) -> inbox("add") ------->   drain inbox (adds, aborts: pages freed now)
                                             core.step(): schedule -> forward -> process
                                             (engine_core.engine_core.EngineCore)
    stream queue  <- call_soon_threadsafe -  publish `started` progress, outputs, KV events, load snapshot
    client gone / abort() -> inbox("abort")

Progress for the gateway's health view: `num_steps` (steps that ran the model), `step_running_s`
(how long the step now running has run) and the measured prefill/decode rates (engine_core.step_rates)
go out on GetLoad; a request that asked for it (`report_started`) gets a `started` message each time
it leaves the queue.

A request's stream ends when all `params.n` output indices report a finish reason, or at once on
ABORT or ERROR. If a step raises, every request in flight ends with an error (the loop goes on).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from duet.contract import FinishReason
from engine_core.engine_core import EngineCore
from engine_core.errors import (
    EngineDrainingError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from engine_core.metrics import EngineMetrics
from engine_core.request import KvEvent, LoadStats, Request, StepOutput
from engine_core.scheduler_protocol import Runner, Scheduler
from engine_core.step_rates import StepRates
from engine_core.step_trace import StepTrace, TracingRunner

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    queue: asyncio.Queue
    num_outputs: int
    arrival: float
    report_started: bool = False
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


DEBUG_STEP_DELAY_ENV = "DUET_DEBUG_STEP_DELAY_MS"


def debug_step_delay_s() -> float:
    """A TEST KNOB, never for production: `DUET_DEBUG_STEP_DELAY_MS` makes the step thread sleep that
    long after every step that did work, a deliberately slowed build, so that a test can show that
    `duet bench baseline check` catches a regression (docs/operations.md, "The upgrade gate")."""
    raw = os.environ.get(DEBUG_STEP_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{DEBUG_STEP_DELAY_ENV} must be a number of milliseconds, got {raw!r}") from None
    if not 0 <= ms <= 10_000:
        raise ValueError(f"{DEBUG_STEP_DELAY_ENV} must be in [0, 10000] ms, got {raw!r}")
    return ms / 1000.0


class StepLoop:
    """Owns the step thread. Call `start()` from the event loop, `stop()` at shutdown."""

    def __init__(self, scheduler: Scheduler, runner: Runner, *, metrics: EngineMetrics | None = None,
                 max_pending: int = 4096) -> None:
        self.trace = StepTrace.from_env()  # DUET_STEP_TRACE (engine_core.step_trace): off unless asked for
        if self.trace is not None:
            runner = TracingRunner(runner)
        self.core = EngineCore(scheduler, runner)
        self.scheduler = scheduler
        self.runner = runner
        self.metrics = metrics
        self.max_pending = max_pending
        self.draining = False
        self.load: LoadStats = scheduler.load()  # replaced (not mutated) each step: safe to read anywhere
        self.rates = StepRates()  # written by the step thread; readers get a float, never a torn value
        # a scheduler that budgets its steps in time (engine_paged's --max-decode-step-stretch) is told each
        # step's duration: it reads no clock itself
        self._observe_step = getattr(scheduler, "observe_step", None)
        self._step_began: float | None = None  # time.monotonic() when the running step began
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}  # event-loop side
        self._active: dict[str, int] = {}  # step-thread side: request id -> outputs not finished
        self._kv_subscribers: set[asyncio.Queue] = set()
        self._kv_sequence = 0
        self._idle = asyncio.Event()
        self._debug_delay_s = debug_step_delay_s()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="duet-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def step_running_s(self) -> float:
        began = self._step_began
        return time.monotonic() - began if began is not None else 0.0

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, wait up to `timeout` s for those in flight; abort the rest.
        True when everything finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            for request_id in list(self._streams):
                self.abort(request_id)
            return False

    # -- event-loop API -----------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Stream the request's outputs. Raises InvalidRequestError/CapacityError before any
        work when the scheduler rejects it; EngineOverloadedError/EngineDrainingError when the
        worker takes no more. Leaving the iteration early (cancel) aborts the request."""
        if self.draining or self._loop is None:
            raise EngineDrainingError("this worker is draining or not ready; retry on another worker")
        if len(self._streams) >= self.max_pending:
            raise EngineOverloadedError(f"{len(self._streams)} requests in flight (limit {self.max_pending})")
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        self.scheduler.validate(request)
        stream = _Stream(asyncio.Queue(), max(1, request.params.n), request.arrival_time, request.report_started)
        self._streams[request.request_id] = stream
        self._idle.clear()
        self._send(("add", request))
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        done = False
        try:
            while not done:
                out: StepOutput = await stream.queue.get()
                if out.started:
                    if stream.report_started:
                        yield out
                    continue
                self._observe(stream, out)
                if out.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                    done = True
                elif out.finish_reason is not None:
                    stream.finished.add(out.index)
                    done = len(stream.finished) >= stream.num_outputs
                if out.finish_reason is FinishReason.ERROR:
                    if self.metrics:
                        self.metrics.finished("error")
                    raise out.error or RequestFailedError("the engine failed this request")
                if done and self.metrics:
                    self.metrics.e2e.observe(time.monotonic() - stream.arrival)
                    self.metrics.finished(out.finish_reason.value)
                yield out
        finally:
            del self._streams[request.request_id]
            if not done:
                self._send(("abort", request.request_id))
            if not self._streams:
                self._idle.set()

    def abort(self, request_id: str) -> bool:
        """Abort from the Abort RPC; the stream ends with FinishReason.ABORT."""
        if request_id not in self._streams:
            return False
        self._send(("abort", request_id))
        return True

    async def kv_events(self) -> AsyncIterator[tuple[int, list[KvEvent]]]:
        """(sequence, events) batches from now on; sequence increases by one per batch."""
        q: asyncio.Queue = asyncio.Queue()
        self._kv_subscribers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._kv_subscribers.discard(q)

    # -- step thread --------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            outputs = self._drain_inbox()
            try:
                worked = self._step(outputs)
            except Exception as exc:  # a bug or a device error: fail what is in flight, keep serving
                log.exception("engine step failed")
                worked = True
                outputs = []
                for request_id in list(self._active):
                    self.scheduler.abort(request_id)
                    outputs.append(StepOutput(request_id, 0, [], finish_reason=FinishReason.ERROR,
                                              error=RequestFailedError(f"engine step failed: {exc}")))
                self._publish(outputs)
            if not worked:
                self._wake.wait(timeout=0.1)

    def _drain_inbox(self) -> list[StepOutput]:
        outputs = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                self.scheduler.add(payload)
                self._active[payload.request_id] = max(1, payload.params.n)
            elif payload in self._active and self.scheduler.abort(payload):
                # pages are free now, before the next schedule
                outputs.append(StepOutput(payload, 0, [], finish_reason=FinishReason.ABORT))

    def _step(self, outputs: list[StepOutput]) -> bool:
        t0 = self._step_began = time.monotonic()
        began_wall = time.time() if self.trace is not None else 0.0  # the trace's clock, only when tracing
        try:
            result = self.core.step()
        finally:
            self._step_began = None
        if self._debug_delay_s and result.did_work:
            # the test knob above: a slower build, on purpose; its steps measure slower too (the rates
            # admission control divides by), as a really slower build's would
            time.sleep(self._debug_delay_s)
        if result.ran_model:
            seconds = time.monotonic() - t0
            self.rates.observe(seconds, result.prefill_tokens, result.decode_tokens)
            if self._observe_step is not None:
                self._observe_step(seconds, result.prefill_tokens, result.decode_tokens)
            if self.trace is not None:
                self.trace.write(began_wall, time.monotonic() - t0, self.runner)
        # a request's `started` goes out before the tokens of the same step
        outputs += [StepOutput(rid, 0, [], started=True) for rid in result.started]
        outputs += result.outputs
        self.load = self.scheduler.load()
        if self.metrics:
            self.metrics.update(self.load)
        self._publish(outputs, result.kv_events)
        return result.did_work or bool(outputs)

    def _publish(self, outputs: list[StepOutput], events: list[KvEvent] | None = None) -> None:
        for out in outputs:
            if out.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                self._active.pop(out.request_id, None)
            elif out.finish_reason is not None and out.request_id in self._active:
                self._active[out.request_id] -= 1
                if self._active[out.request_id] <= 0:
                    del self._active[out.request_id]
        if events:
            self._kv_sequence += 1
        if (outputs or events) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, self._kv_sequence if events else 0, events)

    # -- event loop ---------------------------------------------------------------------
    def _dispatch(self, outputs: list[StepOutput], sequence: int, events: list[KvEvent] | None) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
        if events:
            for q in self._kv_subscribers:
                q.put_nowait((sequence, events))

    def _observe(self, stream: _Stream, out: StepOutput) -> None:
        if not out.token_ids or self.metrics is None:
            return
        now = time.monotonic()
        if stream.first_token is None:
            stream.first_token = now
            self.metrics.ttft.observe(now - stream.arrival)
        elif out.index in stream.last_token and not out.replaces_previous:
            gap = (now - stream.last_token[out.index]) / len(out.token_ids)
            for _ in out.token_ids:
                self.metrics.inter_token.observe(gap)
        stream.last_token[out.index] = now
        self.metrics.generation_tokens.inc(len(out.token_ids))
