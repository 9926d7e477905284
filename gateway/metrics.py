"""Prometheus metrics of one gateway (`GET /metrics`), `duet_` prefix, vLLM meanings.

Each app owns its own registry, so several gateways in one test process do not collide.
Latencies are histograms labelled by model, engine kind, canary variant and traffic class
(gateway/serving/request_class.py); route decisions are counted by reason (the names of
gateway.routing.route_types.REASONS).

Series labelled by worker live as long as the worker is in the fleet: `forget_worker` (called when one leaves,
gateway/backends/fleet.py) removes every one of them, so that workers coming and going under new ids
(autoscaling, rolling restarts) do not grow /metrics without bound or leave ghosts on dashboards. A worker
still in the fleet but failing its health checks stays, as `duet_worker_healthy` 0.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LAT = ("model", "engine", "variant", "class")  # class: gateway.serving.request_class.CLASSES
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0)
_ERROR_BUCKETS = (-8192, -4096, -2048, -1024, -512, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("duet_gateway_requests", "HTTP requests by endpoint and status",
                                ("endpoint", "status"), registry=r)
        self.ttft = Histogram("duet_time_to_first_token_seconds", "Time to first token (gateway)",
                              _LAT, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("duet_inter_token_latency_seconds", "Time between streamed tokens",
                             _LAT, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("duet_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             _LAT, buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens", ("model",), registry=r)
        self.cached_tokens = Counter("duet_prompt_cached_tokens", "Prompt tokens the engine served from cache",
                                     ("model", "engine"), registry=r)
        self.generation_tokens = Counter("duet_generation_tokens", "Generated tokens", ("model",), registry=r)
        self.route_decisions = Counter("duet_route_decisions", "Routing decisions by reason",
                                       ("reason", "engine", "variant"), registry=r)
        self.estimated_reuse = Histogram("duet_route_estimated_reuse", "Estimated prefix reuse at routing",
                                         buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.route_seconds = Histogram("duet_route_decision_seconds", "Time to make a routing decision",
                                       buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3), registry=r)
        self.retries = Counter("duet_worker_retries", "Requests retried on another worker before the first token",
                               ("worker",), registry=r)
        self.stream_errors = Counter("duet_stream_errors", "Streams ended by an engine failure mid-stream",
                                     ("worker",), registry=r)
        self.cancelled = Counter("duet_client_cancelled", "Requests whose client went away", registry=r)
        self.worker_healthy = Gauge("duet_worker_healthy", "1 if the worker passes health checks",
                                    ("worker", "engine"), registry=r)
        self.worker_running = Gauge("duet_worker_num_requests_running", "Running requests per worker (GetLoad)",
                                    ("worker",), registry=r)
        self.worker_kv_usage = Gauge("duet_worker_kv_cache_usage_perc", "KV usage per worker (GetLoad)",
                                     ("worker",), registry=r)
        self.kv_events = Counter("duet_kv_events", "KV events applied to the block index", ("kind",), registry=r)
        self.pool_target = Gauge("duet_pool_target_workers", "Workers of each engine kind the pool planner asks for",
                                 ("kind",), registry=r)
        self.pool_current = Gauge("duet_pool_current_workers", "Serving (healthy, not draining) workers per kind",
                                  ("kind",), registry=r)
        self.pool_work = Gauge("duet_pool_work_tokens_per_second",
                               "Work routed to each kind (uncached prefill + weighted decode + backlog), tokens/s",
                               ("kind",), registry=r)
        self.route_cache_error = Histogram(
            "duet_route_cached_tokens_error", "Engine's real cached_tokens minus the router's estimate for the "
            "chosen worker (tokens; negative: the router expected more)", ("engine",),
            buckets=_ERROR_BUCKETS, registry=r)
        self.route_stale = Counter("duet_route_stale_decisions",
                                   "Decisions whose cache estimate exceeded the real cached tokens by a block or "
                                   "more (the worker had evicted blocks the index still listed)",
                                   ("engine",), registry=r)
        # routing's latency model against what requests saw, per worker (gateway/routing/calibration.py): 1 is
        # exact, 2 means the worker's requests took twice the predicted time (routing scales by it)
        self.route_ttft_correction = Gauge("duet_route_ttft_correction", "Observed over predicted TTFT of the "
                                           "worker's recent requests (routing's learned correction)", ("worker",),
                                           registry=r)
        self.route_tpot_correction = Gauge("duet_route_tpot_correction", "Observed over predicted TPOT of the "
                                           "worker's recent requests (routing's learned correction)", ("worker",),
                                           registry=r)
        self.pending = Gauge("duet_gateway_pending_requests", "Requests inside the gateway", registry=r)
        self.state_healthy = Gauge("duet_state_store_up", "1 if the state store (Redis) is reachable", registry=r)
        self.state_errors = Gauge("duet_state_store_errors", "Failed state store (Redis) calls since start",
                                  registry=r)
        self.stream_timeouts = Counter("duet_stream_timeouts", "Generate calls ended by the first-token or stall "
                                       "timeout", ("worker",), registry=r)
        self.breaker_opened = Counter("duet_worker_breaker_opened", "Times a worker's circuit breaker opened",
                                      ("worker",), registry=r)
        self.admission_refused = Counter("duet_admission_refused", "Requests refused at once (429) because the "
                                         "engines could not start them within their band's bound "
                                         "(max_queue_wait_s, the tenant's fair share of it) or the "
                                         "client's timeout", ("model", "band"), registry=r)

    def forget_worker(self, worker_id: str, engine: str) -> None:
        """The worker left the fleet: its series go (`engine`: the engine kind `duet_worker_healthy` named it with)."""
        _remove(self.worker_healthy, worker_id, engine)
        for metric in (self.worker_running, self.worker_kv_usage, self.route_ttft_correction,
                       self.route_tpot_correction, self.retries, self.stream_errors, self.stream_timeouts,
                       self.breaker_opened):
            _remove(metric, worker_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never set for these labels (older prometheus_client releases raise, newer ignore it)
        pass
