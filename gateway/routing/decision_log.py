"""A bounded ring of the gateway's most recent routing decisions, for `GET /admin/decisions`.

The request path calls `DecisionLog.record(...)` once per routed request (O(1), no I/O); the admin API
reads `recent(limit)`, newest first. Memory is bounded by `capacity` whatever the traffic.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DecisionRecord:
    """One routing decision as the operator sees it (the fields of RouteDecision plus request context)."""

    at: float  # wall-clock seconds (time.time()), so the dashboard can print it
    request_id: str
    model: str
    worker_id: str
    engine_kind: str
    variant: str
    reason: str  # a route reason (gateway/routing/route_types.py REASONS, or a baseline's)
    estimated_reuse: float
    cached_blocks: int
    num_prompt_tokens: int


class DecisionLog:
    """The last `capacity` decisions; appending past capacity drops the oldest."""

    def __init__(self, capacity: int = 1000, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"DecisionLog capacity must be >= 1, got {capacity}")
        self._ring: deque[DecisionRecord] = deque(maxlen=capacity)
        self._clock = clock

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def __len__(self) -> int:
        return len(self._ring)

    def record(self, *, request_id: str, model: str, decision, num_prompt_tokens: int = 0) -> DecisionRecord:
        """Append a decision. `decision` is a gateway.routing.route_types.RouteDecision (duck-typed: its attributes
        worker_id, engine_kind, variant, reason, estimated_reuse, cached_blocks are read)."""
        rec = DecisionRecord(
            at=self._clock(),
            request_id=request_id,
            model=model,
            worker_id=decision.worker_id,
            engine_kind=decision.engine_kind,
            variant=decision.variant,
            reason=decision.reason,
            estimated_reuse=float(decision.estimated_reuse),
            cached_blocks=int(decision.cached_blocks),
            num_prompt_tokens=int(num_prompt_tokens),
        )
        self._ring.append(rec)
        return rec

    def recent(self, limit: int = 100) -> list[dict]:
        """The newest `limit` decisions, newest first, as JSON-ready dicts."""
        if limit <= 0:
            return []
        out = []
        for rec in reversed(self._ring):
            out.append(asdict(rec))
            if len(out) >= limit:
                break
        return out
