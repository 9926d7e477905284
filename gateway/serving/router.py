"""The routing step, around the policy: the one `Router` that the gateway's dispatch and admission and both
simulators (loadtests/sim/fleet, loadtests/sim/routing) call, so that the bookkeeping has no second copy.

    views()      the workers routing may pick from now (the caller's snapshot function; the gateway's is
                 `gateway_views`: drained workers draining, workers behind an open circuit breaker unhealthy,
                 this gateway's own queued prefill per worker, the load signal), each with the correction
                 this Router learned of its latency model there (`observe`)
    capable()    which of them can serve a request (gateway.routing.policy.capable: model, health,
                 capabilities, canary arm); admission and the wait for a circuit breaker ask it too
    decide()     the policy (Duet's gateway.routing.policy.route, or a baseline), after noting the
                 capability demand of the request for the pool planner: a request only one engine kind can
                 serve keeps a worker of that kind, also when none exists now and it gets a 503
    record()     after a worker answered: the planner's routed kinds, the seen blocks, the worker's block
                 index (the blocks it will cache: an external engine caches whole engine blocks only), then
                 `on_record` (the gateway's metrics and decision log)
    observe()    after a request's answer ended: the TTFT and TPOT it saw against the model's prediction for
                 it on its worker, which that worker's correction learns (gateway/routing/calibration.py);
                 then `on_observe` (the gateway's per-worker correction gauges)
    forget()     a worker left the fleet (gateway/backends/fleet.py `on_gone`): its correction goes (its
                 gauges go with the worker's other series, GatewayMetrics.forget_worker)
    block_size() the tokens per hashed block of a model's prompts

`Router.for_gateway` assembles the gateway's; a simulator passes its own views, clock and tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from duet.contract import (
    HASH_BLOCK_TOKENS,  # tokens per hashed block when no worker of the model has said its own
)
from gateway.backends.fleet import Fleet
from gateway.config import GatewayConfig, load_routing_policy
from gateway.control.pool_tracker import PoolTracker
from gateway.metrics import GatewayMetrics
from gateway.routing.calibration import Correction, LatencyCalibration
from gateway.routing.decision_log import DecisionLog
from gateway.routing.policy import capable, route
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import RouteDecision, RouteRequest, RoutingConfig, WorkerView
from gateway.serving.circuit_breaker import CircuitBreakers

Policy = Callable[[RouteRequest, list[WorkerView], RoutingConfig, "str | None", SeenBlocks, WorkerBlockIndex],
                  RouteDecision]


class Router:
    def __init__(self, views: Callable[[], list[WorkerView]], index: WorkerBlockIndex, *,
                 policy: Policy = route, seen: SeenBlocks | None = None, pool_tracker: PoolTracker | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 engine_block_tokens: Callable[[str], int] = lambda worker_id: 0,
                 block_size: Callable[[str], int] = lambda model_id: HASH_BLOCK_TOKENS,
                 on_record: Callable[[str, RouteRequest, RouteDecision], None] | None = None,
                 calibration: LatencyCalibration | None = None,
                 on_observe: Callable[[str, Correction], None] | None = None) -> None:
        """`engine_block_tokens(worker_id)`: the tokens per KV block of an external engine that caches whole
        blocks only (0: the worker caches every block the gateway hashes)."""
        self._views = views
        self.calibration = calibration if calibration is not None else LatencyCalibration()
        self._on_observe = on_observe
        self.index = index
        self.policy = policy
        self.seen = seen if seen is not None else SeenBlocks()
        self.block_size = block_size
        self._pool_tracker = pool_tracker
        self._clock = clock
        self._engine_block_tokens = engine_block_tokens
        self._on_record = on_record

    @classmethod
    def for_gateway(cls, config: GatewayConfig, fleet: Fleet, index: WorkerBlockIndex, pool_tracker: PoolTracker,
                    breakers: CircuitBreakers, decisions: DecisionLog, metrics: GatewayMetrics) -> Router:
        external = {b.url for b in config.backends}

        def views() -> list[WorkerView]:
            queued = pool_tracker.queued
            open_breakers = breakers.open_workers()
            drained = fleet.drained
            observed = pool_tracker.prefill_rate
            # the engine's own prefill rate where it reports one (Duet's workers; a vLLM server, from its
            # /metrics counters, backend_load.py), else what this gateway saw (an SGLang server: its queued
            # prefill over its time to first token, pool_tracker.py)
            return [replace(v, healthy=v.healthy and v.worker_id not in open_breakers,
                            draining=v.draining or v.worker_id in drained,
                            queued_prefill_tokens=queued(v.worker_id),
                            prefill_tokens_per_s=v.prefill_tokens_per_s or observed(v.worker_id))
                    for v in fleet.views()]

        def engine_block_tokens(worker_id: str) -> int:
            w = fleet.get(worker_id) if worker_id in external else None
            return w.info.page_size if w is not None and w.info is not None else 0

        def block_size(model_id: str) -> int:
            for w in fleet.workers():
                if w.info is not None and w.info.model_id == model_id:
                    return w.info.hash_block_size or w.info.page_size or HASH_BLOCK_TOKENS
            return HASH_BLOCK_TOKENS

        def on_record(request_id: str, req: RouteRequest, decision: RouteDecision) -> None:
            metrics.route_decisions.labels(decision.reason, decision.engine_kind, decision.variant).inc()
            metrics.estimated_reuse.observe(decision.estimated_reuse)
            decisions.record(request_id=request_id, model=req.model, decision=decision,
                             num_prompt_tokens=req.num_prompt_tokens)

        # Duet's policy, or the one the config names (a benchmark baseline: config.load_routing_policy)
        policy = route if config.routing_policy is None else load_routing_policy(config.routing_policy)()
        def on_observe(worker_id: str, correction: Correction) -> None:
            if fleet.get(worker_id) is None:
                return  # a request that ended after its worker left: no gauge for a worker that is gone
            metrics.route_ttft_correction.labels(worker_id).set(correction.ttft)
            metrics.route_tpot_correction.labels(worker_id).set(correction.tpot)

        router = cls(views, index, policy=policy, pool_tracker=pool_tracker, engine_block_tokens=engine_block_tokens,
                     block_size=block_size, on_record=on_record, on_observe=on_observe)
        fleet.on_gone.append(router.forget)
        return router

    def views(self) -> list[WorkerView]:
        learned = self.calibration.correction
        return [replace(v, ttft_correction=c.ttft, tpot_correction=c.tpot) if (c := learned(v.worker_id)) != (1.0, 1.0)
                else v for v in self._views()]

    def capable(self, req: RouteRequest, views: Sequence[WorkerView], config: RoutingConfig) -> list[WorkerView]:
        return capable(req, views, config)

    def decide(self, req: RouteRequest, views: list[WorkerView], config: RoutingConfig,
               affinity_worker: str | None) -> RouteDecision:
        if self._pool_tracker is not None:
            self._pool_tracker.capability_demand(self._clock(), req.required_capabilities)
        return self.policy(req, views, config, affinity_worker, self.seen, self.index)

    def record(self, request_id: str, req: RouteRequest, decision: RouteDecision) -> None:
        if self._pool_tracker is not None:
            self._pool_tracker.routed(self._clock(), decision)
        self.seen.add(req.block_hashes)
        self.index.add(decision.worker_id, self._cacheable(decision.worker_id, req.block_hashes, req.block_tokens))
        if self._on_record is not None:
            self._on_record(request_id, req, decision)

    def observe(self, decision: RouteDecision, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request routed by `decision` ended: its TTFT and TPOT as the client saw them (None: not seen)."""
        if decision.modelled_ttft_s is None and decision.modelled_tpot_s is None:
            return  # no prediction was made (no measured rate, or a baseline policy)
        correction = self.calibration.observe(decision.worker_id, decision.modelled_ttft_s, ttft_s,
                                              decision.modelled_tpot_s, tpot_s)
        if self._on_observe is not None:
            self._on_observe(decision.worker_id, correction)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet: its learned correction goes (one that comes back starts at 1 again, as
        a new worker)."""
        self.calibration.forget(worker_id)

    def _cacheable(self, worker_id: str, hashes: tuple, block_tokens: int) -> tuple:
        """The blocks the worker will cache of a prompt: an external engine whose KV block holds several of
        the gateway's (vLLM's 128 tokens against 16) caches only whole engine blocks."""
        page = self._engine_block_tokens(worker_id)
        if block_tokens and page > block_tokens and page % block_tokens == 0:
            step = page // block_tokens
            return hashes[:len(hashes) // step * step]
        return hashes
