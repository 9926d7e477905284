"""Sliding-window request aggregates: what the dashboard's stream draws and what the canary rollback judges.

The gateway calls `RequestStats.record(...)` once when a request ends (ok or not). Samples older than
`max_window_s` are dropped; at most `max_samples` are kept (oldest dropped first), so memory is bounded
at any request rate. Reads (`window`, `snapshot`) scan the kept samples: cheap at one read a second.

Prometheus histograms answer the same questions for Grafana; this module exists because the gateway itself
needs exact windowed percentiles per variant to decide a rollback, without a Prometheus server.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    at: float  # clock() seconds
    model: str
    engine_kind: str  # "" when the request failed before routing (e.g. no capable worker)
    variant: str
    worker_id: str
    reason: str
    ok: bool
    ttft_s: float | None
    itl_s: float | None  # mean inter-token gap of the request
    output_tokens: int


@dataclass(frozen=True)
class WindowStats:
    """Aggregates over one window. Latency fields are None when no request in the window had one."""

    window_s: float
    count: int
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    output_tokens: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.count if self.count else 0.0

    @property
    def rps(self) -> float:
        return self.count / self.window_s if self.window_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _aggregate(samples: Iterable[Sample], window_s: float) -> WindowStats:
    count = errors = tokens = 0
    ttfts: list[float] = []
    itls: list[float] = []
    for s in samples:
        count += 1
        errors += not s.ok
        tokens += s.output_tokens
        if s.ttft_s is not None:
            ttfts.append(s.ttft_s)
        if s.itl_s is not None:
            itls.append(s.itl_s)
    return WindowStats(
        window_s=window_s,
        count=count,
        errors=errors,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        output_tokens=tokens,
    )


class RequestStats:
    """Recent finished requests, queried by time window and by model/variant/engine."""

    def __init__(
        self,
        max_window_s: float = 300.0,
        max_samples: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_window_s <= 0 or max_samples < 1:
            raise ValueError("RequestStats needs max_window_s > 0 and max_samples >= 1")
        self.max_window_s = max_window_s
        self._samples: deque[Sample] = deque(maxlen=max_samples)
        self._clock = clock

    def record(
        self,
        *,
        model: str,
        ok: bool,
        engine_kind: str = "",
        variant: str = "",
        worker_id: str = "",
        reason: str = "",
        ttft_s: float | None = None,
        itl_s: float | None = None,
        output_tokens: int = 0,
    ) -> None:
        """One finished request. Call it for failures too (ok=False), including ones never routed."""
        now = self._clock()
        self._samples.append(
            Sample(now, model, engine_kind, variant, worker_id, reason, ok, ttft_s, itl_s, int(output_tokens))
        )
        self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.max_window_s
        ring = self._samples
        while ring and ring[0].at < horizon:
            ring.popleft()

    def _recent(self, window_s: float) -> list[Sample]:
        now = self._clock()
        self._prune(now)
        horizon = now - window_s
        out = []
        # newest at the right: walk back until the window's start
        for s in reversed(self._samples):
            if s.at < horizon:
                break
            out.append(s)
        return out

    def window(
        self, window_s: float, *, model: str | None = None, variant: str | None = None,
        engine_kind: str | None = None,
    ) -> WindowStats:
        """Aggregates of the requests that ended in the last `window_s` seconds matching the filters."""
        window_s = min(window_s, self.max_window_s)
        picked = (
            s for s in self._recent(window_s)
            if (model is None or s.model == model)
            and (variant is None or s.variant == variant)
            and (engine_kind is None or s.engine_kind == engine_kind)
        )
        return _aggregate(picked, window_s)

    def snapshot(self, window_s: float = 10.0) -> dict:
        """The JSON the dashboard draws: totals, latency percentiles (ms), and per engine / variant / reason."""
        window_s = min(window_s, self.max_window_s)
        recent = self._recent(window_s)
        total = _aggregate(recent, window_s)

        def by(key: Callable[[Sample], str]) -> dict:
            groups: dict[str, list[Sample]] = {}
            for s in recent:
                groups.setdefault(key(s) or "none", []).append(s)
            out = {}
            for name, group in sorted(groups.items()):
                agg = _aggregate(group, window_s)
                out[name] = {"rps": agg.rps, "errors": agg.errors, "error_rate": agg.error_rate,
                             "ttft_p99_ms": _ms(agg.ttft_p99_s)}
            return out

        reasons = Counter(s.reason or "none" for s in recent if s.ok or s.reason)
        return {
            "window_s": window_s,
            "requests": total.count,
            "rps": total.rps,
            "errors": total.errors,
            "error_rate": total.error_rate,
            "ttft_p50_ms": _ms(total.ttft_p50_s),
            "ttft_p99_ms": _ms(total.ttft_p99_s),
            "itl_p50_ms": _ms(total.itl_p50_s),
            "itl_p99_ms": _ms(total.itl_p99_s),
            "output_tokens_per_s": total.output_tokens / window_s,
            "by_engine": by(lambda s: s.engine_kind),
            "by_variant": by(lambda s: f"{s.model}/{s.variant}" if s.variant else s.model),
            "by_reason": dict(sorted(reasons.items())),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
