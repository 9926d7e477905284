"""The seam between the shared serving loop (`engine_core.step_loop`) and an engine kind.

An engine kind (engine_paged, engine_prefix) supplies one object that satisfies `Scheduler`.
The step loop drives it from ONE dedicated thread, so implementations need no locks, except
`validate`, which the gRPC event loop calls and which must only read immutable config.

One step (`engine_core.engine_core.EngineCore.step`, the only place it is written):

    batch = scheduler.schedule()               # a SchedulerOutput: admit, allocate pages, pick chunks (may preempt)
    logits = runner.forward(batch.chunks)      # the model (engine_core.model_runner.ModelRunner)
    outputs = scheduler.process(batch, logits) # sample, append tokens, detect finish, free pages
    -> outputs are streamed to their callers; finished requests are forgotten

Both kinds are laid out alike: `<kind>.scheduler` (the class that satisfies `Scheduler`: admission, chunked
prefill, preemption), `<kind>.postprocess` (`OutputProcessor`, owned by the scheduler: sampling, appending,
stopping), `<kind>.sequence` (the per-request state and `ScheduledSeq`, one entry of a `SchedulerOutput`) and
`<kind>.block_manager` (page tables over an engine_core `Allocator`). Nothing in a kind imports its scheduler
back. Stopping is `SamplingParams.finish_reason` in both. engine_core never imports an engine kind at module
level (tests/test_import_cycles.py).

`add` and `abort` are called between steps; `abort` must free the request's pages before it
returns, so a cancelled stream's pages are free by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from engine_core.forward_batch import SeqChunk
from engine_core.request import KvEvent, LoadStats, Request, StepOutput

Entry = TypeVar("Entry")


@dataclass
class SchedulerOutput(Generic[Entry]):
    """One step's work, what `schedule` returns: `chunks` go to the runner; `entries[i]` is the scheduler's own
    record of the sequence that made `chunks[i]` (its kind's `ScheduledSeq`), read back by `process`."""

    chunks: list[SeqChunk] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)


class Runner(Protocol):
    """What turns a batch's chunks into logits (engine_core.model_runner.ModelRunner, or a test's fake)."""

    def forward(self, chunks: Sequence[Any]) -> Any:
        """Logits [rows, vocab], one row per requested logits position, in chunk order."""


class Scheduler(Protocol):
    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError (bad input, e.g. prompt longer than the context) or
        CapacityError (can never fit this worker). Called on the event loop: read-only, cheap."""

    def add(self, request: Request) -> None:
        """Queue a validated request. It starts WAITING."""

    def abort(self, request_id: str) -> bool:
        """Drop the request now and free its pages; False if it is unknown or already finished."""

    def schedule(self) -> SchedulerOutput | None:
        """The next batch, or None when there is nothing runnable now. May also return
        immediate outputs through `take_outputs` (e.g. a request that can never fit ends with
        FinishReason.ERROR instead of blocking others)."""

    def process(self, batch: SchedulerOutput, logits: Any) -> list[StepOutput]:
        """Sample from `logits` (one row per logits position of the batch, in order), update the
        requests, free the pages of finished ones, and return what to stream."""

    def take_outputs(self) -> list[StepOutput]:
        """Outputs produced outside `process` (aborts, errors at scheduling); empties the buffer."""

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    def load(self) -> LoadStats:
        """Counts for GetLoad and the metrics."""

    def take_kv_events(self) -> list[KvEvent]:
        """Prefix-cache events since the last call (engines without a prefix cache return [])."""

    def take_started(self) -> list[str]:
        """Ids of requests moved from waiting to running since the last call (a preempted request
        that resumes is listed again); empties the buffer. The gateway's first-token deadline
        runs from this moment, so time spent queued is never taken for a fault."""
