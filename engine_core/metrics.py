"""Prometheus metrics of one engine worker, with vLLM's meanings and a `duet_` prefix.

Latency histograms are observed where the caller sees the tokens (the gRPC stream, in
`engine_core.step_loop`): TTFT from arrival to the first token, inter-token latency between
consecutive tokens of one output, e2e from arrival to the last message. Gauges and counters are
refreshed from the scheduler's LoadStats once per step. Prefix-cache queries and hits are token
counters (rate(hits)/rate(queries) is the hit rate), never a ratio gauge.

Each worker owns a CollectorRegistry, so several workers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine_core.request import LoadStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, engine_kind: str, model_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("engine", "model")
        values = (engine_kind, model_id)
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.ttft = hist("duet_time_to_first_token_seconds", "Arrival to first output token")
        self.inter_token = hist("duet_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("duet_e2e_request_latency_seconds", "Arrival to the request's last output")
        self.running = gauge("duet_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("duet_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("duet_kv_cache_usage_perc", "Fraction of KV pages in use (0..1)")
        self.prompt_tokens = counter("duet_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("duet_generation_tokens", "Output tokens streamed")
        self.requests_finished = Counter("duet_request_success", "Finished requests by finish reason",
                                         labels + ("finished_reason",), registry=r)
        self._labels = values
        self.prefix_queries = counter("duet_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("duet_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("duet_num_preemptions", "Requests preempted (recomputed later)")
        self.reused_evicted = counter("duet_prefix_cache_reused_pages_evicted",
                                      "Cached KV pages evicted after a later request had hit them")
        self.spec_draft = counter("duet_spec_decode_num_draft_tokens", "Speculative draft tokens proposed")
        self.spec_accepted = counter("duet_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self._last = LoadStats(0, 0, 0, 0)

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(*self._labels, reason).inc()

    def update(self, load: LoadStats) -> None:
        """Set gauges and advance counters by the difference to the previous snapshot."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(load.kv_pages_used / load.kv_pages_total if load.kv_pages_total else 0.0)
        last = self._last
        for metric, now, before in (
            (self.prefix_queries, load.prefix_cache_queries_tokens, last.prefix_cache_queries_tokens),
            (self.prefix_hits, load.prefix_cache_hits_tokens, last.prefix_cache_hits_tokens),
            (self.preemptions, load.num_preemptions, last.num_preemptions),
            (self.reused_evicted, load.reused_pages_evicted, last.reused_pages_evicted),
            (self.spec_draft, load.spec_draft_tokens, last.spec_draft_tokens),
            (self.spec_accepted, load.spec_accepted_tokens, last.spec_accepted_tokens),
        ):
            if now > before:
                metric.inc(now - before)
        self._last = load

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Expose /metrics on `port` (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)
