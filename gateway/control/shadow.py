"""Shadow traffic (the dual run), its configuration and what it measured, per model.

A `ShadowConfig` names the candidate pools (an engine kind and version label: Duet's own workers, or an
external backend's pool, gateway/backends/backend_spec.py), the share of live requests to mirror there, the
shadow's own concurrency cap, the load above which no mirror starts, the window its figures cover and the
gates a canary must pass (gateway/control/gates.py). gateway/serving/mirror.py sends the copies; this
module only keeps the books:

    ShadowLedger.record(...)     one finished request of a mirrored pair: the primary's or the shadow's,
                                 with its traffic class, ok, TTFT and TPOT
    ShadowLedger.compared(...)   one greedy pair compared token by token (agreed or not)
    ShadowLedger.dropped(...)    a mirror not sent: the cap, the gateway's load or event-loop lag, a request
                                 the candidate lacks the capability for, no candidate worker
    ShadowLedger.figures(...)    one side's `Figures` over the window (all classes, or one)
    ShadowLedger.report(model)   the JSON `GET /admin/models/{model}/shadow` and the dashboard show

Both sides of the books cover the same requests (the primary's answer to each mirrored request beside the
candidate's), so a ratio compares like with like. The primary's TTFT is the user's (from arrival at the
gateway); the shadow's is from the moment its copy was sent, which comes after the primary's first token.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from gateway.control.gates import Figures, GateError, Gates, Verdict, check
from gateway.control.stats import percentile
from gateway.routing.route_types import Pool, WorkerView

PRIMARY, SHADOW = "primary", "shadow"
DROP_REASONS = ("cap", "load", "lag", "incapable", "no_worker")


class ShadowError(ValueError):
    """A shadow config that cannot be applied: a 400 on the admin API, naming the field."""


@dataclass(frozen=True)
class ShadowConfig:
    model: str
    pools: tuple[Pool, ...]  # the candidate: workers of these pools get the copies
    share: float = 0.1  # of the model's live requests, 0 < share <= 1
    max_concurrency: int = 4  # copies in flight at once; past it a copy is dropped
    drop_above_pending: float = 0.5  # no copy starts while the gateway holds this share of max_pending_requests
    max_loop_lag_ms: float = 10.0  # ... or while the gateway's event loop runs this late (its CPU is short)
    window_s: float = 120.0  # the figures (and the gates) cover the last window_s seconds
    gates: Gates = field(default_factory=Gates)

    def holds(self, w: WorkerView) -> bool:
        return any(p.holds(w) for p in self.pools)

    @classmethod
    def from_dict(cls, model: str, d, max_window_s: float) -> ShadowConfig:
        if not isinstance(d, dict):
            raise ShadowError("the shadow config must be an object")
        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = set(d) - known
        if unknown:
            raise ShadowError(f"unknown shadow field(s): {', '.join(sorted(unknown))}")
        raw_pools = d.get("pools")
        if not isinstance(raw_pools, list) or not raw_pools:
            raise ShadowError("pools: the candidate, a list of {engine_kind, version}, is required")
        try:
            pools = tuple(Pool(str(p["engine_kind"]), str(p.get("version", "*"))) for p in raw_pools)
        except (KeyError, TypeError, AttributeError):
            raise ShadowError("pools: each pool is an object {engine_kind, version}") from None
        numbers = {}
        for name, kind in (("share", float), ("max_concurrency", int), ("drop_above_pending", float),
                           ("max_loop_lag_ms", float), ("window_s", float)):
            value = d.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    kind is int and not isinstance(value, int)):
                raise ShadowError(f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
            numbers[name] = kind(value)
        if not 0 < numbers["share"] <= 1:
            raise ShadowError(f"share must be within (0, 1], got {numbers['share']}")
        if numbers["max_concurrency"] < 1:
            raise ShadowError(f"max_concurrency must be >= 1, got {numbers['max_concurrency']}")
        if not 0 < numbers["drop_above_pending"] <= 1:
            raise ShadowError(f"drop_above_pending must be within (0, 1], got {numbers['drop_above_pending']}")
        if numbers["max_loop_lag_ms"] <= 0:
            raise ShadowError(f"max_loop_lag_ms must be > 0, got {numbers['max_loop_lag_ms']}")
        if not 0 < numbers["window_s"] <= max_window_s:
            raise ShadowError(f"window_s must be within (0, {max_window_s:g}] s, got {numbers['window_s']}")
        try:
            gates = Gates.from_dict(d.get("gates"))
        except GateError as e:
            raise ShadowError(str(e)) from None
        return cls(model=model, pools=pools, gates=gates, **numbers)

    def to_dict(self) -> dict:
        return {"pools": [{"engine_kind": p.engine_kind, "version": p.version} for p in self.pools],
                "share": self.share, "max_concurrency": self.max_concurrency,
                "drop_above_pending": self.drop_above_pending, "max_loop_lag_ms": self.max_loop_lag_ms,
                "window_s": self.window_s,
                "gates": self.gates.to_dict()}


@dataclass(frozen=True)
class _Sample:
    at: float
    model: str
    role: str  # PRIMARY | SHADOW
    cls: str  # the traffic class (gateway/serving/request_class.py)
    ok: bool
    ttft_s: float | None
    tpot_s: float | None


@dataclass(frozen=True)
class _Compared:
    at: float
    model: str
    cls: str
    agreed: bool


class ShadowLedger:
    """The shadow's configs and books, bounded in time (`max_window_s`) and size (`max_samples`)."""

    MAX_WINDOW_S = 300.0  # the default bound of a config's window_s (the gateway config's `shadow:` is checked by it)

    def __init__(self, registry: CollectorRegistry | None = None, max_window_s: float = MAX_WINDOW_S,
                 max_samples: int = 50_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_window_s = max_window_s
        self.configs: dict[str, ShadowConfig] = {}
        self.in_flight: Counter[str] = Counter()  # copies in flight per model (the cap's count)
        self._samples: deque[_Sample] = deque(maxlen=max_samples)
        self._compared: deque[_Compared] = deque(maxlen=max_samples)
        self._dropped: Counter[tuple[str, str]] = Counter()
        self._clock = clock
        registry = registry if registry is not None else CollectorRegistry()
        self.requests_total = PromCounter("duet_shadow_requests", "Mirrored requests answered by the shadow "
                                          "candidate, by outcome", ("model", "outcome"), registry=registry)
        self.dropped_total = PromCounter("duet_shadow_dropped", "Mirrors not sent (cap, load, lag, incapable, "
                                         "no_worker)",
                                         ("model", "reason"), registry=registry)
        self.compared_total = PromCounter("duet_shadow_greedy_compared", "Greedy answers compared with the "
                                          "primary's, by agreement", ("model", "agreed"), registry=registry)

    def set_config(self, config: ShadowConfig | None, model: str | None = None) -> None:
        """Install (None: remove) a model's shadow; its books start afresh."""
        name = config.model if config is not None else model
        self._samples = deque((s for s in self._samples if s.model != name), maxlen=self._samples.maxlen)
        self._compared = deque((c for c in self._compared if c.model != name), maxlen=self._compared.maxlen)
        for key in [k for k in self._dropped if k[0] == name]:
            del self._dropped[key]
        if config is None:
            self.configs.pop(name, None)
        else:
            self.configs[name] = config

    def record(self, model: str, role: str, cls: str, ok: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        self._samples.append(_Sample(self._clock(), model, role, cls, ok, ttft_s, tpot_s))
        if role == SHADOW:
            self.requests_total.labels(model, "ok" if ok else "error").inc()

    def compared(self, model: str, cls: str, agreed: bool) -> None:
        self._compared.append(_Compared(self._clock(), model, cls, agreed))
        self.compared_total.labels(model, str(agreed).lower()).inc()

    def dropped(self, model: str, reason: str) -> None:
        self._dropped[(model, reason)] += 1
        self.dropped_total.labels(model, reason).inc()

    def figures(self, model: str, role: str, window_s: float, cls: str | None = None) -> Figures:
        horizon = self._clock() - min(window_s, self.max_window_s)
        picked = [s for s in self._samples if s.at >= horizon and s.model == model and s.role == role
                  and (cls is None or s.cls == cls)]
        ttfts = [s.ttft_s for s in picked if s.ttft_s is not None]
        tpots = [s.tpot_s for s in picked if s.tpot_s is not None]
        compared = [c for c in self._compared if c.at >= horizon and c.model == model
                    and (cls is None or c.cls == cls)] if role == SHADOW else []
        return Figures(
            requests=len(picked), errors=sum(not s.ok for s in picked),
            ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
            tpot_p50_s=percentile(tpots, 50), tpot_p99_s=percentile(tpots, 99),
            greedy_compared=len(compared), greedy_agreed=sum(c.agreed for c in compared))

    def agreement(self, model: str, window_s: float) -> tuple[int, int]:
        """(greedy pairs compared, agreed) over the window: what the rollback controller adds to the canary's
        live figures during a ramp."""
        f = self.figures(model, SHADOW, window_s)
        return f.greedy_compared, f.greedy_agreed

    def verdict(self, model: str) -> Verdict | None:
        config = self.configs.get(model)
        if config is None:
            return None
        return check(config.gates, self.figures(model, SHADOW, config.window_s),
                     self.figures(model, PRIMARY, config.window_s))

    def report(self, model: str) -> dict | None:
        config = self.configs.get(model)
        if config is None:
            return None
        window = config.window_s
        classes = sorted({s.cls for s in self._samples if s.model == model})
        return {
            "config": config.to_dict(),
            "verdict": self.verdict(model).to_dict(),
            "primary": self.figures(model, PRIMARY, window).to_dict(),
            "shadow": self.figures(model, SHADOW, window).to_dict(),
            "by_class": {c: {PRIMARY: self.figures(model, PRIMARY, window, c).to_dict(),
                             SHADOW: self.figures(model, SHADOW, window, c).to_dict()} for c in classes},
            "in_flight": self.in_flight[model],
            "dropped": {r: self._dropped[(model, r)] for r in DROP_REASONS},
        }

    def gate_error(self, model: str) -> str | None:
        """Why a canary of the model's shadow candidate may not start now; None when it may (or when the model
        has no shadow, whose gates would decide)."""
        verdict = self.verdict(model)
        if verdict is None or verdict.passed:
            return None
        pools = ", ".join(f"{p.engine_kind}@{p.version}" for p in self.configs[model].pools)
        if verdict.failures:
            return f"the shadow's candidate {pools} fails its gates: {'; '.join(verdict.failures)}"
        return f"the shadow's candidate {pools} has not been measured enough to pass its gates: {verdict.waiting_for}"
