"""A circuit breaker per worker: a worker whose calls keep failing is left out of routing for a while.

Health checks catch a worker that is down; the breaker catches one that answers health checks but
fails requests (a broken engine, a wedged device, streams that stall). States per worker:

    closed     routed normally; `failures` consecutive failed calls open it
    open       left out of routing until `open_s` has passed since it opened
    half_open  routed again; the next call's outcome closes it (success) or opens it again (failure)

A failed call is a fault of the worker, never of load (gateway/serving/timeouts.py decides): an error
before the first token or mid-stream, or a stall (silent while the worker makes no progress). Not
counted: a request the engine rejected as invalid, a RESOURCE_EXHAUSTED refusal (the worker is full),
time spent queued, a slow prefill past `first_token_s`, the client's own deadline. Half-open lets
every request through rather than one probe: a failure before the first token is retried on another worker
anyway, so the cost of a bad probe is one retry per request. When every worker of a model is open, a
request waits for the first to turn half-open (`reopens_in`), within its own deadline, rather than
failing at once (gateway/serving/dispatch.py).

`outcome_recorder(breakers, metrics)` is the stream watchdog's `on_outcome`: how each call went, in the
breakers and the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from gateway.serving import timeouts

log = logging.getLogger("duet.gateway")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class _Breaker:
    failures: int = 0
    opened_at: float | None = None


class CircuitBreakers:
    def __init__(self, failures: int = 5, open_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.open_s = open_s
        self.clock = clock
        self._by_worker: dict[str, _Breaker] = {}
        self.opened_total = 0

    def state(self, worker_id: str) -> str:
        b = self._by_worker.get(worker_id)
        if b is None or b.opened_at is None:
            return CLOSED
        return OPEN if self.clock() - b.opened_at < self.open_s else HALF_OPEN

    def allows(self, worker_id: str) -> bool:
        """May a request be routed to this worker now?"""
        return self.state(worker_id) != OPEN

    def record_success(self, worker_id: str) -> None:
        b = self._by_worker.get(worker_id)
        if b is not None:
            b.failures, b.opened_at = 0, None

    def record_failure(self, worker_id: str) -> bool:
        """Count a failed call; True when this opened (or re-opened) the breaker."""
        b = self._by_worker.setdefault(worker_id, _Breaker())
        state = self.state(worker_id)
        b.failures += 1
        if state == HALF_OPEN or (state == CLOSED and b.failures >= self.threshold):
            b.opened_at = self.clock()
            self.opened_total += 1
            return True
        return False

    def reopens_in(self, worker_id: str) -> float | None:
        """Seconds until this worker's open breaker turns half-open; None when it is not open."""
        b = self._by_worker.get(worker_id)
        if b is None or b.opened_at is None or self.state(worker_id) != OPEN:
            return None
        return max(0.0, b.opened_at + self.open_s - self.clock())

    def open_workers(self) -> list[str]:
        return [w for w in self._by_worker if self.state(w) == OPEN]


def outcome_recorder(breakers: CircuitBreakers, metrics: GatewayMetrics) -> Callable[[str, str], None]:
    """How a call went (gateway/serving/timeouts.py): only errors and stalls count against the breaker."""
    def on_outcome(worker_id: str, outcome: str) -> None:
        if outcome in (timeouts.STALL, timeouts.FIRST_TOKEN):
            metrics.stream_timeouts.labels(worker_id).inc()
        if outcome == timeouts.OK:
            breakers.record_success(worker_id)
        elif outcome in (timeouts.ERROR, timeouts.STALL) and breakers.record_failure(worker_id):
            metrics.breaker_opened.labels(worker_id).inc()
            log.warning("circuit breaker of worker %s opened: left out of routing for %.0f s", worker_id,
                        breakers.open_s)
    return on_outcome
