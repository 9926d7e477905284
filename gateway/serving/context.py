"""`ServingContext`: what the request path reads of the running gateway, typed, built once by
gateway/app.py and reached from a request by `serving_context(request)`.

The request path (gateway/serving/start.py, dispatch.py, admission.py, runs.py and the endpoints of
gateway/api/) takes it instead of the whole gateway: what each part is for is in its field's comment.
It holds parts, not logic: each is its own module's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.trace import Tracer
from starlette.requests import Request

from gateway.backends.fleet import Fleet
from gateway.config import GatewayConfig
from gateway.control.limits import KeyLimiter
from gateway.control.pool_tracker import PoolTracker
from gateway.control.state import StateStore
from gateway.control.stats import RequestStats
from gateway.control.workload import Workload
from gateway.metrics import GatewayMetrics
from gateway.models import ServedModel
from gateway.serving.circuit_breaker import CircuitBreakers
from gateway.serving.mirror import Mirror
from gateway.serving.pending import PendingRequests
from gateway.serving.router import Router
from gateway.serving.timeouts import StreamWatchdog


@dataclass(frozen=True)
class ServingContext:
    config: GatewayConfig  # limits, default routing config, affinity TTL, hashed blocks, admin key
    models: Mapping[str, ServedModel]  # by API name: tokenizer, chat template, context length
    metrics: GatewayMetrics
    tracer: Tracer  # the "route" span and each engine call's client span
    state: StateStore  # session affinity, per-model routing configs, stored responses
    fleet: Fleet  # a chosen worker's client and load; failed and drained workers
    router: Router  # views, the policy's decision and its bookkeeping, block size
    watchdog: StreamWatchdog  # first-token and stall timeouts of every engine stream
    breakers: CircuitBreakers  # when a worker behind an open breaker turns half-open
    pending: PendingRequests  # the in-flight cap (max_pending_requests)
    limiter: KeyLimiter  # per-API-key limits
    stats: RequestStats  # each request's outcome (the dashboard, the canary rollback)
    pool_tracker: PoolTracker  # queued prefill per worker, finished work per engine kind
    mirror: Mirror  # shadow traffic: copies of a share of requests to a candidate pool (never awaited)
    workload: Workload  # the live profile and the traffic capture (each request that ends well)


def serving_context(request: Request) -> ServingContext:
    return request.app.state.serving
