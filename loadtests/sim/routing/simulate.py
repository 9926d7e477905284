"""`duet bench simulate-routing`: replay a Mooncake trace through routing policies over
simulated workers, and compare cache hit rates and load balance.

The simulated worker: an LRU cache of `cache_blocks` trace blocks (prefix matched: a request
hits its leading blocks that are cached, then all its blocks become most recent), and a
service-time model - prefill runs one request at a time (FIFO) at `prefill_tokens_per_s` over
the uncached tokens only, then decode takes `decode_s_per_token` per output token, batched
(concurrent). A request is in flight from arrival until its last token, so a worker's load is
its requests in flight (queued for prefill, prefilling or decoding), and cache hits shorten
it. `load_max_over_mean` is the busiest worker's time-averaged in-flight count over the mean
of all workers'.

The "duet" policy is gateway.routing.policy.route itself, called through the gateway's own Router
(gateway/serving/router.py: decide, then record): with the session affinity it recorded, a SeenBlocks
table, and a WorkerBlockIndex fed by the decisions and corrected by the simulated workers' eviction (KV) events. Mooncake has no
session field: loadtests.traces.mooncake.session_key derives one (the conversation's first block),
and the turn count is the number of requests of that session so far.
"""

from __future__ import annotations

import heapq
import statistics
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from gateway.serving.router import Router
from loadtests.sim.routing.baselines import (
    POLICY_NAMES,
    ConsistentHash,
    LeastLoad,
    RoundRobin,
    SGLangCacheAware,
)
from loadtests.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRecord, session_key


@dataclass(frozen=True)
class ServiceModel:
    """Per-worker timing. Defaults: a 7-8B model on one modern GPU, roughly - prefill about
    10k tokens/s, decode 20 ms per token per stream (what `duet engine sim` paces)."""

    prefill_tokens_per_s: float = 10_000.0
    decode_s_per_token: float = 0.020
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


class LruBlockCache:
    """One worker's prefix cache of whole blocks, LRU."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity  # None: unbounded
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def lookup_and_insert(self, hashes: tuple[int, ...]) -> tuple[int, list[int]]:
        """Leading cached blocks of `hashes`; then cache them all. Returns (hits, evicted)."""
        blocks = self.blocks
        hits = 0
        for h in hashes:
            if h not in blocks:
                break
            hits += 1
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        evicted = []
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                evicted.append(blocks.popitem(last=False)[0])
        return hits, evicted


@dataclass
class SimWorker:
    worker_id: str
    cache: LruBlockCache
    prefill_free_at: float = 0.0
    in_flight: list[tuple[float, int]] = field(default_factory=list)  # heap of (done, blocks)
    prefill_starts: deque[float] = field(default_factory=deque)  # FIFO: monotone
    prefills: deque[tuple[float, int]] = field(default_factory=deque)  # (first token at, uncached tokens), FIFO
    queued_prefill_tokens: int = 0  # uncached tokens of requests before their first token (what a gateway counts)
    kv_blocks: int = 0
    busy_s: float = 0.0  # integral of the in-flight count over time

    def advance(self, now: float) -> None:
        while self.in_flight and self.in_flight[0][0] <= now:
            self.kv_blocks -= heapq.heappop(self.in_flight)[1]
        while self.prefill_starts and self.prefill_starts[0] <= now:
            self.prefill_starts.popleft()
        while self.prefills and self.prefills[0][0] <= now:
            self.queued_prefill_tokens -= self.prefills.popleft()[1]

    @property
    def load(self) -> int:
        return len(self.in_flight)

    @property
    def waiting(self) -> int:
        return len(self.prefill_starts)


class DuetPolicy:
    """gateway.routing.policy.route through the gateway's own Router (gateway/serving/router.py): its decide,
    and its record of each decision."""

    name = "duet"

    def __init__(self, num_workers: int, cache_blocks: int | None, config: RoutingConfig | None = None,
                 seen_capacity: int = 200_000, sessions: bool = True, kinds: list[str] | None = None) -> None:
        self.sessions = sessions  # False: anonymous clients, no session key (no affinity)
        # the engine kind of each worker (default: all engine_prefix); the simulated engines differ only
        # in the kind routing sees, so a mixed fleet shows what routing by kind does to caches and queues
        self.kinds = kinds or ["prefix"] * num_workers
        self.config = (config or RoutingConfig()).validate()
        self.views: list[WorkerView] = []  # the snapshot of the request being routed
        # the gateway's own Router (its decide and record); this replay has no pool planner
        self.router = Router(lambda: self.views, WorkerBlockIndex(cache_blocks or 1 << 30),
                             seen=SeenBlocks(seen_capacity))
        self.affinity: dict[str, str] = {}
        self.turns: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.engines: Counter[str] = Counter()
        self.cache_blocks = cache_blocks
        self.sequence = 0  # requests routed so far (RouteRequest.sequence)

    def choose(self, rec: TraceRecord, workers: list[SimWorker]) -> int:
        key = session_key(rec) if self.sessions else None
        if key is not None:
            self.turns[key] += 1
        self.views = [
            WorkerView(
                worker_id=w.worker_id, model_id="trace", engine_kind=self.kinds[i], version="v1",
                capabilities=frozenset(), healthy=True, draining=False,
                num_running=w.load - w.waiting, num_waiting=w.waiting,
                kv_usage=min(1.0, w.kv_blocks / self.cache_blocks) if self.cache_blocks else 0.0,
                queued_prefill_tokens=w.queued_prefill_tokens,
            )
            for i, w in enumerate(workers)
        ]
        req = RouteRequest(
            model="trace", block_hashes=rec.hash_ids, num_prompt_tokens=rec.input_length,
            session_key=key, turn_count=self.turns[key] if key is not None else 1,
            block_tokens=MOONCAKE_BLOCK_TOKENS, sequence=self.sequence,
        )
        self.sequence += 1
        affinity = self.affinity.get(key) if key is not None else None
        d = self.router.decide(req, self.router.views(), self.config, affinity)
        self.router.record(f"trace-{req.sequence}", req, d)
        self.reasons[d.reason] += 1
        self.engines[d.engine_kind] += 1
        if key is not None:
            self.affinity[key] = d.worker_id
        return next(i for i, w in enumerate(workers) if w.worker_id == d.worker_id)

    def observe(self, worker: int, rec: TraceRecord, evicted: list[int], workers: list[SimWorker]) -> None:
        if evicted:  # the worker's KV events
            self.router.index.apply_kv_event(workers[worker].worker_id, "evicted", evicted)

    def extra(self) -> dict:
        return {"reasons": dict(self.reasons), "engines": dict(self.engines)}


def make_policy(name: str, num_workers: int, cache_blocks: int | None, config: RoutingConfig | None = None,
                sessions: bool = True):
    if name == "duet":
        return DuetPolicy(num_workers, cache_blocks, config, sessions=sessions)
    classes = {"round_robin": RoundRobin, "least_load": LeastLoad, "consistent_hash": ConsistentHash,
               "sglang_cache_aware": SGLangCacheAware}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    return classes[name](num_workers)


def simulate(
    records: list[TraceRecord], policy, num_workers: int, cache_blocks: int | None,
    service: ServiceModel = ServiceModel(), time_scale: float = 1.0, slo_ttft_s: float | None = None,
) -> dict:
    """Replay `records` (in timestamp order) through `policy`; the per-policy result object."""
    workers = [SimWorker(f"w{i}", LruBlockCache(cache_blocks)) for i in range(num_workers)]
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    ttfts = []
    for rec in sorted(records, key=lambda r: r.timestamp_ms):
        now = rec.timestamp_ms / 1000.0 * time_scale
        for w in workers:
            w.advance(now)
        i = policy.choose(rec, workers)
        w = workers[i]
        hits, evicted = w.cache.lookup_and_insert(rec.hash_ids)
        policy.observe(i, rec, evicted, workers)
        cached_tokens = min(rec.input_length - 1, hits * service.block_tokens)
        hit_blocks += hits
        total_blocks += len(rec.hash_ids)
        hit_tokens += cached_tokens
        total_tokens += rec.input_length
        start = max(now, w.prefill_free_at)
        first_token = start + (rec.input_length - cached_tokens) / service.prefill_tokens_per_s
        w.prefill_free_at = first_token
        w.prefills.append((first_token, rec.input_length - cached_tokens))
        w.queued_prefill_tokens += rec.input_length - cached_tokens
        done = first_token + rec.output_length * service.decode_s_per_token
        heapq.heappush(w.in_flight, (done, len(rec.hash_ids)))
        w.kv_blocks += len(rec.hash_ids)
        if start > now:
            w.prefill_starts.append(start)
        w.busy_s += done - now
        ttfts.append(first_token - now)
    loads = [w.busy_s for w in workers]
    mean = statistics.fmean(loads)
    ttfts.sort()
    result = {
        "hit_rate": hit_blocks / total_blocks,
        "token_hit_rate": hit_tokens / total_tokens,
        "load_max_over_mean": max(loads) / mean if mean > 0 else 1.0,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }
    if slo_ttft_s is not None:  # goodput: requests whose first token came within the SLO, per second of trace
        stamps = [r.timestamp_ms for r in records]
        span = max(1e-9, (max(stamps) - min(stamps)) / 1000.0 * time_scale)
        good = sum(1 for t in ttfts if t <= slo_ttft_s)
        result["slo_attainment"] = good / len(ttfts)
        result["goodput_rps"] = good / span
    if hasattr(policy, "extra"):
        result.update(policy.extra())
    return result


def global_cache_hit_rate(records: list[TraceRecord], capacity: int | None) -> float:
    """Block hit rate of ONE LRU cache of `capacity` blocks (None: unbounded) serving all."""
    cache = LruBlockCache(capacity)
    hits = total = 0
    for rec in sorted(records, key=lambda r: r.timestamp_ms):
        h, _ = cache.lookup_and_insert(rec.hash_ids)
        hits += h
        total += len(rec.hash_ids)
    return hits / total


def run(
    trace: str, num_workers: int = 8, cache_blocks: int | None = 2048, time_scale: float = 1.0,
    policies: tuple[str, ...] = POLICY_NAMES, limit: int | None = None,
    service: ServiceModel = ServiceModel(), config: RoutingConfig | None = None, sessions: bool = True,
) -> dict:
    """The whole report: the global-cache reference and every policy's result."""
    from loadtests.traces.formats import load_any

    if num_workers < 1:
        raise ValueError(f"--workers must be >= 1, got {num_workers}")
    if cache_blocks is not None and cache_blocks < 1:
        raise ValueError(f"--cache-blocks must be >= 1, got {cache_blocks}")
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    records = load_any(trace)
    records = records[:limit] if limit else records
    total = None if cache_blocks is None else cache_blocks * num_workers
    out = {
        "trace": trace,
        "records": len(records),
        "workers": num_workers,
        "cache_blocks": cache_blocks,
        "time_scale": time_scale,
        "sessions": sessions,
        "global_cache_hit_rate": global_cache_hit_rate(records, total),
        "policies": {},
    }
    for name in policies:
        policy = make_policy(name, num_workers, cache_blocks, config, sessions)
        out["policies"][name] = simulate(records, policy, num_workers, cache_blocks, service, time_scale)
    return out


def format_table(result: dict) -> str:
    g = result["global_cache_hit_rate"]
    lines = [
        (f"trace {result['trace']}: {result['records']} requests, {result['workers']} workers x "
         f"{result['cache_blocks']} blocks, time scale {result['time_scale']}"),
        (f"global cache ({result['workers']} x {result['cache_blocks']} blocks in one LRU): "
         f"block hit rate {g:.4f}"),
        "",
        "| policy | block hit rate | vs global | token hit rate | load max/mean | TTFT p50 s | TTFT p99 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in result["policies"].items():
        lines.append(
            f"| {name} | {p['hit_rate']:.4f} | {p['hit_rate'] / g if g else float('nan'):.3f} | "
            f"{p['token_hit_rate']:.4f} | {p['load_max_over_mean']:.3f} | {p['ttft_p50_s']:.2f} | "
            f"{p['ttft_p99_s']:.2f} |"
        )
    duet = result["policies"].get("duet")
    if duet and "reasons" in duet:
        lines += ["", "duet route reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(duet["reasons"].items()))]
    return "\n".join(lines)
