"""`duet bench advise --simulate`: the options in the routing simulator (loadtests/sim/routing/simulate.py:
per-worker LRU block caches, FIFO prefill, batched decode; seconds for a whole trace), judged by the one rule
(loadtests/advise/rule.py):

    all_paged, all_prefix  N workers of one kind behind the SGLang-style cache-aware routing
                           (loadtests/sim/routing/baselines.py)
    duet_k                 k engine_paged + (N - k) engine_prefix behind Duet's routing, for every k in 1..N-1
    prefix_duet_routing    N engine_prefix behind Duet's routing: what the routing alone is worth

The simulated engines differ only in the kind routing sees, so the comparison measures what routing by kind
does to caches and queues (documents kept off the session workers' caches, sessions kept together); all_paged
and all_prefix come out alike, and the choice between them falls to the trace's reuse (rule.PREFIX_REUSE).
"""


from __future__ import annotations

from dataclasses import dataclass, field

from duet.traffic_classes import CPU, bound_of
from loadtests.advise.rule import recommend
from loadtests.sim.routing.baselines import SGLangCacheAware
from loadtests.sim.routing.simulate import DuetPolicy, ServiceModel, global_cache_hit_rate, simulate
from loadtests.traces.mooncake import TraceRecord


@dataclass(frozen=True)
class AdviseSettings:
    workers: int = 8
    cache_blocks: int = 2048  # per worker, in 512-token trace blocks
    time_scale: float = 1.0
    slo_ttft_s: float = bound_of("session", CPU).ttft_ms / 1000  # a conversation trace's turns: 2 s
    limit: int | None = None
    service: ServiceModel = field(default_factory=ServiceModel)

    def validate(self) -> AdviseSettings:
        if self.workers < 2:
            raise ValueError(f"--workers must be >= 2 (a split needs one worker of each kind), got {self.workers}")
        if self.cache_blocks < 1 or self.time_scale <= 0 or self.slo_ttft_s <= 0:
            raise ValueError("--cache-blocks >= 1, --time-scale > 0 and --slo-ttft-s > 0 required")
        return self


def _stack(records: list[TraceRecord], kinds: list[str], policy: str, s: AdviseSettings) -> dict:
    router = DuetPolicy(len(kinds), s.cache_blocks, kinds=kinds) if policy == "duet" else SGLangCacheAware(len(kinds))
    r = simulate(records, router, len(kinds), s.cache_blocks, s.service, s.time_scale, s.slo_ttft_s)
    r["workers"] = {"paged": kinds.count("paged"), "prefix": kinds.count("prefix")}
    return r


def simulate_all(records: list[TraceRecord], s: AdviseSettings) -> dict:
    """Every option in the simulator (module docstring): {name: result}."""
    n = s.workers
    out = {"all_paged": _stack(records, ["paged"] * n, "sglang_cache_aware", s),
           "all_prefix": _stack(records, ["prefix"] * n, "sglang_cache_aware", s)}
    for k in range(1, n):
        out[f"duet_{k}"] = _stack(records, ["paged"] * k + ["prefix"] * (n - k), "duet", s)
    out["prefix_duet_routing"] = _stack(records, ["prefix"] * n, "duet", s)
    return out


def reuse_share(records: list[TraceRecord]) -> float:
    """Share of prompt blocks that repeat an earlier prompt's prefix (an unbounded cache's hit rate)."""
    return global_cache_hit_rate(records, None)


def advise_simulated(trace: str, s: AdviseSettings) -> dict:
    from loadtests.traces.formats import detect_format, load_any

    s.validate()
    records = load_any(trace)
    records = records[: s.limit] if s.limit else records
    results = simulate_all(records, s)
    reuse = reuse_share(records)
    return {"trace": str(trace), "format": detect_format(trace), "records": len(records), "mode": "simulated",
            "settings": {"workers": s.workers, "cache_blocks": s.cache_blocks, "time_scale": s.time_scale,
                         "slo_ttft_s": s.slo_ttft_s},
            "stacks": results, "recommendation": recommend(results, reuse)}


