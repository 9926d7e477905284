"""The gateway application: `build_app(config)` -> a Starlette app built from explicit lists.

Assembly only. `Gateway` builds one gateway's parts from its config and wires them together: the
request path reads them through `serving` (gateway/serving/context.py), the admin API through `admin`
(gateway/control/admin_backend.py). Its lifespan starts and stops their background work (worker
polling, the Redis state store, rollback ticks, the stream watchdog, key-lease renewal, the pool
planner's tick). What each part does is its own module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from duet.contract import HASH_BLOCK_TOKENS
from gateway.api import completions, health, messages, responses, tokenize
from gateway.backends.engine_client import GrpcEngineClient
from gateway.backends.fleet import Fleet
from gateway.backends.http_backend import with_backends
from gateway.config import GatewayConfig
from gateway.control.admin import admin_routes
from gateway.control.admin_backend import GatewayAdmin
from gateway.control.limits import KeyLimiter, LeaseMiddleware
from gateway.control.migration import migration_routes
from gateway.control.pool_tracker import PoolTracker
from gateway.control.rollback import RollbackController
from gateway.control.shadow import ShadowLedger
from gateway.control.shadow_sync import ShadowSync
from gateway.control.state.memory import MemoryStore
from gateway.control.stats import RequestStats
from gateway.control.workload import Workload, workload_routes
from gateway.errors import http_exception_response
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
from gateway.routing.prefix_index import WorkerBlockIndex
from gateway.serving.circuit_breaker import CircuitBreakers, outcome_recorder
from gateway.serving.context import ServingContext
from gateway.serving.mirror import Mirror
from gateway.serving.pending import PendingRequests
from gateway.serving.router import Router
from gateway.serving.timeouts import StreamWatchdog


class Gateway:
    def __init__(self, config: GatewayConfig, models: dict[str, ServedModel] | None = None, state=None,
                 tracer_provider=None, client_factory=None) -> None:
        t = config.timeouts
        self.config = config
        self.models = models if models is not None else load_models(config.model_paths)
        self.metrics = GatewayMetrics()
        self.tracer_provider = tracer_provider
        # a state store passed in is the caller's to start; the gateway starts the Redis store it makes
        self._starts_state = state is None and bool(config.redis)
        if state is None and config.redis:
            from gateway.control.state.redis_store import RedisStore  # redis is imported only when configured

            state = RedisStore(config.redis)
        self.state = state if state is not None else MemoryStore()
        self.metrics.state_healthy.set_function(lambda: 1.0 if self.state.healthy else 0.0)
        self.metrics.state_errors.set_function(lambda: float(getattr(self.state, "redis_errors_total", 0)))
        self.stats = RequestStats()
        self.shadow = ShadowLedger(self.metrics.registry)
        self.rollback = RollbackController(self.state, self.stats, registry=self.metrics.registry,
                                           shadow=self.shadow)
        index = WorkerBlockIndex()
        # a backend URL gets an HTTP client (gateway/backends/http_backend.py), any other address a gRPC one
        clients = with_backends(client_factory or functools.partial(
            GrpcEngineClient, keepalive_time_s=t.keepalive_time_s, keepalive_timeout_s=t.keepalive_timeout_s,
            request_timeout_s=t.request_s, rpc_timeout_s=t.rpc_s),
            config.backends, self.models, HASH_BLOCK_TOKENS, t, idle_poll_s=config.idle_poll_s)
        self.fleet = Fleet(config.workers + tuple(b.url for b in config.backends), index, self.metrics,
                           state=self.state, poll_interval_s=config.poll_interval_s, client_factory=clients,
                           max_step_s=t.first_token_s or t.stall_s)
        self.breakers = CircuitBreakers(t.breaker_failures, t.breaker_open_s)
        self.pool_tracker = PoolTracker(self.metrics, config.pool_planner)
        self.fleet.on_gone.append(self.pool_tracker.forget)
        self.decisions = DecisionLog()
        self.router = Router.for_gateway(config, self.fleet, index, self.pool_tracker, self.breakers,
                                         self.decisions, self.metrics)
        self.limiter = KeyLimiter(config.key_limits, config.redis)
        self.watchdog = StreamWatchdog(t, on_outcome=outcome_recorder(self.breakers, self.metrics),
                                       progress_at=self.fleet.progress_at)
        self.workload = Workload(config.capture, self.state, self.metrics.registry, profile=config.profile)
        self.pending = PendingRequests(config.limits.max_pending_requests, self.metrics.pending)
        self.mirror = Mirror(self.shadow, self.fleet, self.pending, t.request_s)
        self.shadow_sync = ShadowSync(self.shadow, self.state, config.shadow)
        self.serving = ServingContext(
            config=config, models=self.models, metrics=self.metrics,
            tracer=trace.get_tracer("duet.gateway", tracer_provider=tracer_provider), state=self.state,
            fleet=self.fleet, router=self.router, watchdog=self.watchdog, breakers=self.breakers,
            pending=self.pending, limiter=self.limiter, stats=self.stats, pool_tracker=self.pool_tracker,
            mirror=self.mirror, workload=self.workload)
        self.admin = GatewayAdmin(
            config=config, models=self.models, state=self.state, stats=self.stats, decisions=self.decisions,
            rollback=self.rollback, fleet=self.fleet, pool_tracker=self.pool_tracker, shadow=self.shadow,
            shadow_sync=self.shadow_sync)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        if self._starts_state:
            await self.state.start()
        await self.fleet.start()
        await self.shadow_sync.start()
        tasks = [asyncio.create_task(work) for work in (self.rollback.run(), self.watchdog.run(), self.limiter.run(),
                                                        self.pool_tracker.run(self.router.views), self.mirror.run(),
                                                        self.workload.capture.run(), self.shadow_sync.run())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await self.mirror.close()
            await self.fleet.close()
            await self.state.close()
            await self.limiter.close()


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
        *admin_routes(gw.admin),
        *migration_routes(gw.admin),
        *workload_routes(gw.admin, gw.workload),
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
    app.state.gateway = gw  # the parts, for tests and operators' scripts
    app.state.serving = gw.serving  # what the request path reads (serving_context(request))
    return app
