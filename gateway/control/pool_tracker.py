"""What the gateway measures about its pools, and the routing accuracy it sees.

- Queued prefill tokens per worker (routing's load signal, `WorkerView.queued_prefill_tokens`): the
  estimated uncached prompt tokens of every request sent to the worker that has not yet produced its
  first message. The gateway counts its own requests, so no engine has to report it. The same count per
  tenant (API key) and worker is flow control's fairness signal (gateway/serving/admission.py).
- The prefill rate each worker showed this gateway (`prefill_rate`, routing's predicted TTFT where the engine
  reports no rate of its own, as an SGLang server's metrics give none; a vLLM server's come from its counters,
  gateway/backends/backend_load.py): over its last `RATE_WINDOW` first tokens, the
  prefill each request waited for (the tokens queued there when it was sent, its own included) over the
  seconds it waited beyond the window's shortest wait (the fixed cost of any first token). A ratio of sums,
  as the engines' own rates (engine_core/step_rates.py): the rate a queue of prefill drains at.
- Work per engine kind (gateway/control/pool_planner.WorkMeter): each finished request's real uncached
  prompt tokens and generated tokens, charged to the kind routing WANTED for it (a prompt that
  spilled to the other kind still shows demand for the kind it was meant for), and the planner's
  target split, exported as `duet_pool_target_workers{kind}` and on `GET /admin/pools`.
- Which kinds the traffic needs (the planner's `needed`): a kind that a recent request required a
  capability of (duet/contract.py PAGED_CAPABILITIES, PREFIX_CAPABILITIES), even if the request
  found no worker of that kind. And what the load on a kind is: requests running on a kind count as its
  traffic before any has finished, unless this gateway's recent requests there were all wanted by the
  other kind (spilled to it, or kept where their prefix was cached): then that kind is serving the
  other's demand, and the planner may still give all its workers up.
- Routing accuracy: the engine's real `cached_tokens` against the router's estimate for the
  worker it chose (`cached_blocks` x block size, capped at the prompt): a histogram of the
  difference, and a counter of stale decisions, where the estimate exceeded the real figure by at
  least a block (the worker had evicted blocks the index still listed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from duet.contract import ENGINE_KINDS as KINDS
from duet.contract import PAGED, PAGED_CAPABILITIES, PREFIX, PREFIX_CAPABILITIES
from gateway.control.pool_planner import PlannerConfig, PoolPlanner, WorkMeter, kind_work
from gateway.routing.route_types import RouteDecision, WorkerView
from gateway.ticks import sleep_to_tick

_CAPABILITIES_OF = {PAGED: PAGED_CAPABILITIES, PREFIX: PREFIX_CAPABILITIES}
RATE_WINDOW = 32  # first tokens per worker the observed prefill rate is measured over


def estimated_cached_tokens(decision: RouteDecision, block_size: int, prompt_tokens: int) -> int:
    return min(decision.cached_blocks * block_size, max(0, prompt_tokens - 1))


def wanted_kind(decision: RouteDecision) -> str:
    """The kind routing chose before a spill, or a pool without that kind, sent the request to the
    other one (so a kind with no worker still shows its demand to the planner)."""
    return decision.wanted_kind or decision.engine_kind


def _add(counts: dict, key, tokens: int) -> None:
    left = counts.get(key, 0) + tokens
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class PoolTracker:
    def __init__(self, metrics, config: PlannerConfig | None = None) -> None:
        self.metrics = metrics
        self.config = (config or PlannerConfig()).validate()
        self.meter = WorkMeter(self.config.window_s)
        self.planner = PoolPlanner(self.config)
        self._prefill: dict[str, tuple[str, int, str | None]] = {}  # request id -> (worker id, tokens, tenant)
        self._queued: dict[str, int] = {}  # worker id -> tokens
        self._by_tenant: dict[tuple[str | None, str], int] = {}  # (tenant, worker id) -> tokens
        self._sent: dict[str, tuple[float, int]] = {}  # request id -> (when sent, prefill tokens ahead of it)
        self._waited: dict[str, deque[tuple[int, float]]] = {}  # worker id -> (tokens waited for, seconds)
        self.current: dict[str, int] = {k: 0 for k in KINDS}
        self.recent: deque[tuple[int, bool]] = deque(maxlen=1000)  # (real - estimate, stale) per request
        self._needed_at: dict[str, float] = {}  # kind -> when a request last needed a capability of it
        self._routed_at: dict[tuple[str, str], float] = {}  # (kind served on, kind wanted) -> last routed

    # -- demand at routing time ----------------------------------------------------------------
    def capability_demand(self, now: float, required: frozenset[str]) -> None:
        for kind, capabilities in _CAPABILITIES_OF.items():
            if required & capabilities:
                self._needed_at[kind] = now

    def routed(self, now: float, decision: RouteDecision) -> None:
        self._routed_at[(decision.engine_kind, wanted_kind(decision))] = now

    def needed(self, now: float) -> frozenset[str]:
        return frozenset(k for k, t in self._needed_at.items() if now - t <= self.config.window_s)

    def _serves_only_the_other_kind(self, now: float, kind: str) -> bool:
        other = next(k for k in KINDS if k != kind)
        recent = {wanted for (served, wanted), t in self._routed_at.items()
                  if served == kind and now - t <= self.config.window_s}
        return recent == {other}

    # -- queued prefill ----------------------------------------------------------------------
    def prefill_started(self, request_id: str, worker_id: str, tokens: int, tenant: str | None = None,
                        now: float | None = None) -> None:
        self.prefill_done(request_id)
        self._prefill[request_id] = (worker_id, tokens, tenant)
        self._sent[request_id] = (time.monotonic() if now is None else now, self.queued(worker_id) + tokens)
        _add(self._queued, worker_id, tokens)
        _add(self._by_tenant, (tenant, worker_id), tokens)

    def first_token(self, request_id: str, now: float | None = None) -> None:
        """The request's first message came: what it waited for, and how long, feeds its worker's rate."""
        sent, entry = self._sent.get(request_id), self._prefill.get(request_id)
        if sent is None or entry is None:
            return
        waited = (time.monotonic() if now is None else now) - sent[0]
        if waited > 0 and sent[1] > 0:
            self._waited.setdefault(entry[0], deque(maxlen=RATE_WINDOW)).append((sent[1], waited))

    def prefill_rate(self, worker_id: str) -> float:
        """Prefill tokens per second this worker served this gateway's requests at (0.0: none measured yet)."""
        samples = self._waited.get(worker_id)
        if not samples:
            return 0.0
        # a first token costs a fixed time whatever the prefill (the HTTP hops, one engine step, the gateway's
        # own work): the shortest wait of the window, taken off every wait, so the rate is the marginal one
        # that a queue of prefill drains at (measured with the fixed time in, a loaded 2-core machine made
        # every queue of a few short prompts look seconds long, and routing spread a shared prefix for nothing)
        floor = min(s for _, s in samples)
        seconds = sum(s - floor for _, s in samples)
        tokens = sum(n for n, _ in samples)
        if seconds <= 0:  # every wait the same: no marginal rate to see; the plain ratio
            seconds = sum(s for _, s in samples)
        return tokens / seconds

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet (gateway/backends/fleet.py `on_gone`): its observed rate goes, so that
        workers coming and going under new ids do not grow the table (its queued tokens go to zero as its
        requests end)."""
        self._waited.pop(worker_id, None)

    def prefill_done(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        entry = self._prefill.pop(request_id, None)
        if entry is not None:
            worker_id, tokens, tenant = entry
            _add(self._queued, worker_id, -tokens)
            _add(self._by_tenant, (tenant, worker_id), -tokens)

    def queued(self, worker_id: str) -> int:
        return self._queued.get(worker_id, 0)

    def queued_by_tenant(self, worker_ids: Iterable[str]) -> dict[str | None, int]:
        """Tenant -> its queued prefill tokens on these workers (tenants with none are left out)."""
        workers = set(worker_ids)
        out: dict[str | None, int] = {}
        for (tenant, worker_id), tokens in self._by_tenant.items():
            if worker_id in workers:
                out[tenant] = out.get(tenant, 0) + tokens
        return out

    # -- finished requests ---------------------------------------------------------------------
    def finished(self, now: float, decision: RouteDecision, block_size: int, prompt_tokens: int,
                 cached_tokens: int, completion_tokens: int) -> None:
        self.meter.record(wanted_kind(decision), now, prompt_tokens - cached_tokens, completion_tokens)
        estimate = estimated_cached_tokens(decision, block_size, prompt_tokens)
        stale = estimate - cached_tokens >= block_size
        self.recent.append((cached_tokens - estimate, stale))
        self.metrics.route_cache_error.labels(decision.engine_kind).observe(cached_tokens - estimate)
        if stale:
            self.metrics.route_stale.labels(decision.engine_kind).inc()

    # -- the planner tick ----------------------------------------------------------------------
    def tick(self, now: float, views: Iterable[WorkerView]) -> dict[str, int]:
        views = list(views)
        # the fleet: healthy workers, draining ones included (a worker drained to switch its kind is
        # still part of it; counting it out would look like the fleet shrinking)
        self.current = {k: sum(1 for v in views if v.healthy and v.engine_kind == k) for k in KINDS}
        rates = self.meter.rates(now)
        queued = {k: sum(self.queued(v.worker_id) for v in views if v.engine_kind == k) for k in KINDS}
        work = {k: kind_work(rates[k][0], rates[k][1], queued[k], self.config) for k in KINDS}
        for k in KINDS:  # requests still running on a kind are traffic, even before any has finished
            if work[k] == 0 and any(v.healthy and v.engine_kind == k and v.load > 0 for v in views) and (
                    not self._serves_only_the_other_kind(now, k)):
                work[k] = 1e-6
        # no change until the rates cover a whole window: a fresh gateway has seen too little
        warming = self.meter.started_at is None or now - self.meter.started_at < self.config.window_s
        target = self.planner.update(now, work, self.current, hold=warming, needed=self.needed(now))
        for k in KINDS:
            self.metrics.pool_target.labels(k).set(target[k])
            self.metrics.pool_current.labels(k).set(self.current[k])
            self.metrics.pool_work.labels(k).set(work[k])
        return target

    async def run(self, views: Callable[[], Iterable[WorkerView]], interval_s: float = 1.0) -> None:
        """The planner's tick every `interval_s` over the views routing reads (the gateway's lifespan task)."""
        while True:
            await sleep_to_tick(interval_s)
            self.tick(time.monotonic(), views())

    def report(self, now: float) -> dict:
        out = self.planner.report(self.current, self.meter.rates(now))
        out["needed"] = sorted(self.needed(now))
        n = len(self.recent)
        out["accuracy"] = {
            "decisions": n,
            "mean_error_tokens": sum(e for e, _ in self.recent) / n if n else None,
            "mean_abs_error_tokens": sum(abs(e) for e, _ in self.recent) / n if n else None,
            "stale_share": sum(1 for _, s in self.recent if s) / n if n else 0.0,
        }
        return out
