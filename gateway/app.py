"""The gateway application: `build_app(config)` -> a Starlette app built from explicit lists.

`Gateway` holds the running state every handler shares (models, worker pool, state store, prefix
tables, metrics, stats, decision log, canary rollback) and its lifespan starts and stops the
background work (worker polling, Redis subscriber, rollback ticks). It is also the `AdminBackend`
of gateway/control/admin.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from dataclasses import replace

from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from gateway.api import completions, health, messages, responses, tokenize
from gateway.backends.engine_client import GrpcEngineClient
from gateway.backends.fleet import WorkerPool
from gateway.backends.http_backend import with_backends
from gateway.config import GatewayConfig, load_routing_policy
from gateway.control.admin import admin_routes
from gateway.control.limits import KeyLimiter, LeaseMiddleware
from gateway.control.pool_tracker import PoolTracker
from gateway.control.rollback import RollbackController
from gateway.control.stats import RequestStats
from gateway.errors import QueueFull, http_exception_response
from gateway.metrics import GatewayMetrics
from gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ErrorShieldMiddleware,
    RequestIdMiddleware,
    TracingMiddleware,
)
from gateway.models import ServedModel, load_models
from gateway.openapi import openapi_json
from gateway.routing.decision_log import DecisionLog
from gateway.routing.policy import route
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.serving import timeouts
from gateway.serving.circuit_breaker import CircuitBreakers
from gateway.serving.timeouts import StreamWatchdog

log = logging.getLogger("duet.gateway")

DEFAULT_BLOCK_SIZE = 16


class Gateway:
    def __init__(self, config: GatewayConfig, models: dict[str, ServedModel] | None = None, state=None,
                 tracer_provider=None, client_factory=None) -> None:
        self.config = config
        # Duet's policy, or the one the config names (a benchmark baseline; gateway.config.load_routing_policy)
        self.policy = route if config.routing_policy is None else load_routing_policy(config.routing_policy)()
        self.admin_key = config.admin_key
        self.models = models if models is not None else load_models(config.model_paths)
        self.metrics = GatewayMetrics()
        self.seen = SeenBlocks()
        self.index = WorkerBlockIndex()
        self.stats = RequestStats()
        self.decisions = DecisionLog()
        self.tracer_provider = tracer_provider
        self.tracer = trace.get_tracer("duet.gateway", tracer_provider=tracer_provider)
        self._state = state
        self.rollback: RollbackController | None = None
        self.pool: WorkerPool | None = None
        t = config.timeouts
        self._client_factory = with_backends(client_factory or functools.partial(
            GrpcEngineClient, keepalive_time_s=t.keepalive_time_s, keepalive_timeout_s=t.keepalive_timeout_s,
            request_timeout_s=t.request_s, rpc_timeout_s=t.rpc_s),
            config.backends, self.models, DEFAULT_BLOCK_SIZE, t)  # external servers: gateway/backends/http_backend.py
        self.breakers = CircuitBreakers(t.breaker_failures, t.breaker_open_s)
        self.limiter = KeyLimiter(config.key_limits, config.redis)
        self.watchdog = StreamWatchdog(t, on_outcome=self._call_outcome, progress_at=self._progress_at)
        self.pending = 0
        self.drained: set[str] = set()
        self.pools = PoolTracker(self.metrics, config.pool_planner)
        self._tasks: list[asyncio.Task] = []

    @property
    def state(self):
        return self._state

    # -- lifespan -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._loop = asyncio.get_running_loop()
        if self._state is None:
            if self.config.redis:
                from gateway.control.state.redis_store import RedisStore

                self._state = RedisStore(self.config.redis)
                await self._state.start()
            else:
                from gateway.control.state.memory import MemoryStore

                self._state = MemoryStore()
        self.metrics.state_healthy.set_function(lambda: 1.0 if self._state.healthy else 0.0)
        self.metrics.state_errors.set_function(lambda: float(getattr(self._state, "redis_errors_total", 0)))
        self.rollback = RollbackController(self._state, self.stats, registry=self.metrics.registry)
        addresses = self.config.workers + tuple(b.url for b in self.config.backends)
        self.pool = WorkerPool(addresses, self.index, self.metrics, state=self._state,
                               poll_interval_s=self.config.poll_interval_s, client_factory=self._client_factory,
                               max_step_s=self.config.timeouts.first_token_s or self.config.timeouts.stall_s)
        await self.pool.start()
        self._tasks.append(asyncio.create_task(self._rollback_loop()))
        self._tasks.append(asyncio.create_task(self.watchdog.run()))
        self._tasks.append(asyncio.create_task(self.limiter.run()))
        self._tasks.append(asyncio.create_task(self._pool_loop()))
        try:
            yield
        finally:
            for t in self._tasks:
                t.cancel()
            await self.pool.close()
            await self._state.close()
            await self.limiter.close()

    async def _rollback_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.rollback.tick()

    async def _pool_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.pools.tick(time.monotonic(), self.views())

    def pool_report(self) -> dict:
        return self.pools.report(time.monotonic())

    # -- the request path -----------------------------------------------------------------------
    def admit(self) -> None:
        """Count one more request inside the gateway, or refuse it (429) when the queue is full."""
        if self.pending >= self.config.limits.max_pending_requests:
            raise QueueFull(f"the gateway has {self.pending} requests in flight "
                            f"(max_pending_requests={self.config.limits.max_pending_requests}); retry later")
        self.pending += 1
        self.metrics.pending.set(self.pending)

    def release(self) -> None:
        self.pending -= 1
        self.metrics.pending.set(self.pending)

    def _progress_at(self, worker_id: str) -> float:
        return self.pool.progress_at(worker_id) if self.pool is not None else -math.inf

    def _call_outcome(self, worker_id: str, outcome: str) -> None:
        """How a call went (gateway/serving/timeouts.py): only errors and stalls count against the breaker."""
        if outcome in (timeouts.STALL, timeouts.FIRST_TOKEN):
            self.metrics.stream_timeouts.labels(worker_id).inc()
        if outcome == timeouts.OK:
            self.breakers.record_success(worker_id)
        elif outcome in (timeouts.ERROR, timeouts.STALL) and self.breakers.record_failure(worker_id):
            self.metrics.breaker_opened.labels(worker_id).inc()
            log.warning("circuit breaker of worker %s opened: left out of routing for %.0f s", worker_id,
                        self.breakers.open_s)

    def block_size(self, model_id: str) -> int:
        for w in self.pool.workers():
            if w.info is not None and w.info.model_id == model_id:
                return w.info.hash_block_size or w.info.page_size or DEFAULT_BLOCK_SIZE
        return DEFAULT_BLOCK_SIZE

    def route(self, req, *args):
        """The routing policy, after noting the capability demand of `req` for the pool planner: a
        request only one engine kind can serve keeps a worker of that kind, also when none exists now
        and this request is refused with a 503."""
        self.pools.capability_demand(time.monotonic(), req.required_capabilities)
        return self.policy(req, *args)

    def record_decision(self, prep, req, decision) -> None:
        self.pools.routed(time.monotonic(), decision)
        self.seen.add(req.block_hashes)
        self.index.add(decision.worker_id, self._cacheable(decision.worker_id, req.block_hashes, req.block_tokens))
        self.metrics.route_decisions.labels(decision.reason, decision.engine_kind, decision.variant).inc()
        self.metrics.estimated_reuse.observe(decision.estimated_reuse)
        self.decisions.record(request_id=prep.request_id, model=req.model, decision=decision,
                              num_prompt_tokens=req.num_prompt_tokens)

    def _cacheable(self, worker_id: str, hashes: tuple, block_tokens: int) -> tuple:
        """The blocks the worker will cache of a prompt: an external engine whose KV block holds several of
        the gateway's (vLLM's 128 tokens against 16) caches only whole engine blocks."""
        if not self.config.backends or worker_id not in {b.url for b in self.config.backends}:
            return hashes
        w = self.pool.get(worker_id) if self.pool is not None else None
        page = w.info.page_size if w is not None and w.info is not None else 0
        if block_tokens and page > block_tokens and page % block_tokens == 0:
            step = page // block_tokens
            return hashes[:len(hashes) // step * step]
        return hashes

    # -- AdminBackend ---------------------------------------------------------------------------
    def model_ids(self) -> list[str]:
        return list(self.models)

    def worker_rows(self) -> list[dict]:
        rows = []
        for w in self.pool.workers() if self.pool else ():
            load, info = w.load, w.info
            queries = load.prefix_cache_queries_tokens if load else 0
            rows.append({
                "worker_id": w.worker_id, "address": w.address,
                "model_id": info.model_id if info else "", "engine_kind": info.engine_kind if info else "",
                "version": info.version if info else "", "healthy": w.healthy,
                "draining": w.worker_id in self.drained or bool(load and load.draining),
                "num_running": load.num_running if load else 0, "num_waiting": load.num_waiting if load else 0,
                "kv_usage": load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0,
                "prefix_hit_rate": load.prefix_cache_hits_tokens / queries if queries else 0.0,
                "num_preemptions": load.num_preemptions if load else 0,
                "reused_pages_evicted": load.reused_pages_evicted if load else 0,
            })
        return rows

    def drain_worker(self, worker_id: str) -> bool:
        if self.pool is None or self.pool.get(worker_id) is None:
            return False
        self.drained.add(worker_id)
        return True

    def views(self):
        queued = self.pools.queued
        open_breakers = self.breakers.open_workers()
        return [replace(v, healthy=v.healthy and v.worker_id not in open_breakers,
                        draining=v.draining or v.worker_id in self.drained,
                        queued_prefill_tokens=queued(v.worker_id)) for v in self.pool.views()]


def build_app(config: GatewayConfig, **gateway_kwargs) -> Starlette:
    gw = Gateway(config, **gateway_kwargs)
    routes = [
        Route("/v1/chat/completions", completions.chat_completions, methods=["POST"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/v1/models", tokenize.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", tokenize.retrieve_model, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/version", tokenize.version, methods=["GET"]),
        Route("/health", health.health, methods=["GET"]),
        Route("/ready", health.ready, methods=["GET"]),
        Route("/metrics", health.metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *admin_routes(gw),
    ]
    middleware = [
        Middleware(RequestIdMiddleware),
        Middleware(ErrorShieldMiddleware),
        Middleware(TracingMiddleware, tracer_provider=gw.tracer_provider),
        Middleware(BodyLimitMiddleware, max_bytes=config.limits.max_body_bytes),
        Middleware(ApiKeyMiddleware, api_keys=config.api_keys),
        Middleware(LeaseMiddleware, limiter=gw.limiter),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=gw.lifespan,
                    exception_handlers={HTTPException: http_exception_response})
    app.state.gateway = gw
    return app
