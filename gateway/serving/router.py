"""The routing step of the request path, around the policy: which workers routing may pick now (`views`),
the policy's choice (`decide`), what is recorded after it (`record`), and the block size a model's prompts
are hashed with (`block_size`).

    views()    the fleet's snapshot with drained workers draining, workers behind an open circuit breaker
               unhealthy, and this gateway's own queued prefill per worker (the load signal)
    decide()   the policy (Duet's gateway.routing.policy.route unless the config names a baseline), after
               noting the capability demand of the request for the pool planner: a request only one engine
               kind can serve keeps a worker of that kind, also when none exists now and it gets a 503
    record()   after a worker answered: the planner's routed kinds, the seen blocks, the worker's block index
               (the blocks it will cache), the metrics and the decision log
"""

from __future__ import annotations

import time
from dataclasses import replace

from duet.contract import (
    HASH_BLOCK_TOKENS,  # tokens per hashed block when no worker of the model has said its own
)
from gateway.backends.fleet import Fleet
from gateway.config import GatewayConfig, load_routing_policy
from gateway.control.pool_tracker import PoolTracker
from gateway.metrics import GatewayMetrics
from gateway.routing.decision_log import DecisionLog
from gateway.routing.policy import route
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import RouteDecision, RouteRequest, RoutingConfig, WorkerView
from gateway.serving.circuit_breaker import CircuitBreakers


class Router:
    def __init__(self, config: GatewayConfig, fleet: Fleet, index: WorkerBlockIndex,
                 pool_tracker: PoolTracker, breakers: CircuitBreakers, decisions: DecisionLog,
                 metrics: GatewayMetrics) -> None:
        # Duet's policy, or the one the config names (a benchmark baseline: config.load_routing_policy)
        self.policy = route if config.routing_policy is None else load_routing_policy(config.routing_policy)()
        self.seen = SeenBlocks()
        self.index = index
        self._external = {b.url for b in config.backends}
        self._fleet = fleet
        self._pool_tracker = pool_tracker
        self._breakers = breakers
        self._decisions = decisions
        self._metrics = metrics

    def views(self) -> list[WorkerView]:
        queued = self._pool_tracker.queued
        open_breakers = self._breakers.open_workers()
        drained = self._fleet.drained
        return [replace(v, healthy=v.healthy and v.worker_id not in open_breakers,
                        draining=v.draining or v.worker_id in drained,
                        queued_prefill_tokens=queued(v.worker_id)) for v in self._fleet.views()]

    def decide(self, req: RouteRequest, views: list[WorkerView], config: RoutingConfig,
               affinity_worker: str | None) -> RouteDecision:
        self._pool_tracker.capability_demand(time.monotonic(), req.required_capabilities)
        return self.policy(req, views, config, affinity_worker, self.seen, self.index)

    def record(self, request_id: str, req: RouteRequest, decision: RouteDecision) -> None:
        self._pool_tracker.routed(time.monotonic(), decision)
        self.seen.add(req.block_hashes)
        cached = self._cacheable(decision.worker_id, req.block_hashes, req.block_tokens)
        self.index.add(decision.worker_id, cached)
        self._metrics.route_decisions.labels(decision.reason, decision.engine_kind, decision.variant).inc()
        self._metrics.estimated_reuse.observe(decision.estimated_reuse)
        self._decisions.record(request_id=request_id, model=req.model, decision=decision,
                               num_prompt_tokens=req.num_prompt_tokens)

    def block_size(self, model_id: str) -> int:
        for w in self._fleet.workers():
            if w.info is not None and w.info.model_id == model_id:
                return w.info.hash_block_size or w.info.page_size or HASH_BLOCK_TOKENS
        return HASH_BLOCK_TOKENS

    def _cacheable(self, worker_id: str, hashes: tuple, block_tokens: int) -> tuple:
        """The blocks the worker will cache of a prompt: an external engine whose KV block holds several of
        the gateway's (vLLM's 128 tokens against 16) caches only whole engine blocks."""
        if worker_id not in self._external:
            return hashes
        w = self._fleet.get(worker_id)
        page = w.info.page_size if w is not None and w.info is not None else 0
        if block_tokens and page > block_tokens and page % block_tokens == 0:
            step = page // block_tokens
            return hashes[:len(hashes) // step * step]
        return hashes
