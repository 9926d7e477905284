"""`duet bench compare`: the headline experiment — which engine, for which traffic?

The same mixed workload (multi-turn chat sessions, agent loops and unrelated long documents, in
equal shares of the requests, arriving together: Poisson arrivals of conversations and documents,
open loop, seeded) runs against three stacks of the same size on the same checkpoint:

    paged_round_robin   every worker engine_paged, the gateway's round_robin policy
    prefix_cache_aware  every worker engine_prefix, the gateway's cache_aware policy
    duet                half engine_paged, half engine_prefix, the gateway's own routing

All three go through the real gateway (`RoutingConfig.policy` picks the policy) and real engine
workers with identical limits (`loadtests.stack.EngineLimits`), one after the other. For each
configuration: goodput (requests meeting both the TTFT and the TPOT SLO, per second), TTFT
p50/p99 per traffic class, the engine and route-reason split from the `x-duet-*` headers, and each
worker's load (requests running + waiting, sampled from the gateway twice a second) and prefix
cache hit rate. `run(settings)` returns one JSON-ready dict (see `_config_result` and `_headline`).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from loadtests.client import RequestRecord, arun_benchmark
from loadtests.report import Slo, summarize
from loadtests.stack import EngineLimits, ServingStack
from loadtests.workloads import BenchRequest, TokenSource, mix

CONFIGS = {
    # name: (engine kinds of the workers, given the worker count; routing policy)
    "paged_round_robin": (lambda n: ["paged"] * n, "round_robin"),
    "prefix_cache_aware": (lambda n: ["prefix"] * n, "cache_aware"),
    "duet": (lambda n: ["paged"] * (n // 2) + ["prefix"] * (n - n // 2), "duet"),
}
SHARES = {"multi_turn": 1.0, "agent": 1.0, "long_doc": 1.0}


class CompareError(ValueError):
    """Settings that cannot make the experiment (the message names the setting)."""


@dataclass(frozen=True)
class Settings:
    """One experiment. The defaults are the full run (about 5 minutes on 2 shared CPU cores); QUICK
    is the --quick one (about 2). The SLOs are fixed, the same for every configuration: about 3-5x
    the TTFT and TPOT medians of the bench checkpoint at light load on one CPU thread per worker
    (docs/benchmarks.md), so that an unqueued request meets them and a queued one does not."""

    model: str | None = None  # None: the bench checkpoint, made once in the cache dir
    workers: int = 2
    num_requests: int = 180
    rate: float = 1.5  # conversations + documents started per second (Poisson)
    max_prompt_tokens: int = 1024
    max_tokens: int = 32
    seed: int = 0
    ttft_slo_ms: float = 4000.0
    itl_slo_ms: float = 250.0  # bound on each request's mean inter-token latency (TPOT)
    limits: EngineLimits = field(default_factory=EngineLimits)
    configs: tuple[str, ...] = tuple(CONFIGS)
    ready_timeout_s: float = 300.0

    def validate(self) -> Settings:
        if self.workers < 2:
            raise CompareError(f"--workers must be at least 2 (duet needs one engine of each kind), got {self.workers}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise CompareError(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
        if not self.rate > 0:
            raise CompareError(f"--rate must be positive, got {self.rate}")
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise CompareError("--slo-ttft-ms and --slo-itl-ms must be positive")
        return self


QUICK = Settings(num_requests=48)


def bench_checkpoint() -> Path:
    """The `bench` checkpoint, made once under the cache dir (DUET_CACHE_DIR overrides) and reused."""
    from duet.model_make import cached_model_dir

    return cached_model_dir("bench", "llama")


def workload(model: Path, s: Settings) -> list[BenchRequest]:
    src = TokenSource.from_model_dir(model)
    return mix(src, s.num_requests, s.max_prompt_tokens, s.max_tokens, s.seed, SHARES)


async def _sample_load(stack: ServingStack, samples: dict[str, list[tuple[int, int]]], stop: asyncio.Event) -> None:
    """(running, waiting) per worker, twice a second, as the gateway sees it (GetLoad polling)."""
    while not stop.is_set():
        for row in await asyncio.to_thread(stack.workers):
            samples.setdefault(row["worker_id"], []).append((row["num_running"], row["num_waiting"]))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def _measure(stack: ServingStack, model_id: str, requests, encode, s: Settings):
    samples: dict[str, list[tuple[int, int]]] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_load(stack, samples, stop))
    try:
        records = await arun_benchmark(stack.url, model_id, requests, rate=s.rate, encode=encode,
                                       progress=False, seed=s.seed)
    finally:
        stop.set()
        await sampler
    return records, samples


def run_config(name: str, model: Path, requests: list[BenchRequest], s: Settings, encode,
               log_dir: Path | None = None) -> dict:
    kinds_of, policy = CONFIGS[name]
    kinds = kinds_of(s.workers)
    t0 = time.monotonic()
    with ServingStack(model, kinds, {"policy": policy}, s.limits, s.ready_timeout_s, log_dir) as stack:
        started_s = time.monotonic() - t0
        records, samples = asyncio.run(_measure(stack, model.name, requests, encode, s))
        final = {row["worker_id"]: row for row in stack.workers()}
    return _config_result(name, kinds, policy, records, samples, final, s, started_s)


def _config_result(name: str, kinds: list[str], policy: str, records: list[RequestRecord],
                   samples: dict, final: dict, s: Settings, started_s: float) -> dict:
    summary = summarize(records, Slo(ttft_ms=s.ttft_slo_ms, itl_ms=s.itl_slo_ms))

    def cls(g: dict) -> dict:
        return {"num_requests": g["num_requests"], "num_errors": g["num_errors"], "num_good": g["num_good"],
                "goodput_rps": g["goodput_rps"], "ttft_p50_ms": g["ttft_ms"]["p50"], "ttft_p99_ms": g["ttft_ms"]["p99"],
                "tpot_p50_ms": g["tpot_ms"]["p50"], "tpot_p99_ms": g["tpot_ms"]["p99"],
                "cached_token_ratio": g["cached_token_ratio"]}

    workers = {}
    for wid in sorted(set(samples) | set(final)):
        loads = [r + w for r, w in samples.get(wid, [])]
        row = final.get(wid, {})
        workers[wid] = {
            "engine": row.get("engine_kind"),
            "requests": sum(1 for r in records if r.worker == wid),
            "mean_load": sum(loads) / len(loads) if loads else None,
            "max_load": max(loads) if loads else None,
            "max_waiting": max((w for _, w in samples.get(wid, [])), default=None),
            "prefix_hit_rate": row.get("prefix_hit_rate"),
        }
    reasons: dict[str, dict[str, int]] = {}
    for r in records:
        if r.route_reason is not None:
            per = reasons.setdefault(r.traffic_class, {})
            per[r.route_reason] = per.get(r.route_reason, 0) + 1
    return {
        "workers": kinds, "policy": policy, "startup_s": round(started_s, 1),
        "goodput_rps": summary["goodput_rps"], "request_throughput_rps": summary["request_throughput_rps"],
        "num_requests": summary["num_requests"], "num_good": summary["num_good"],
        "num_errors": summary["num_errors"], "errors": summary["errors"], "duration_s": summary["duration_s"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
        "classes": {c: cls(g) for c, g in summary["by_class"].items()},
        "engines": {e: g["num_requests"] for e, g in summary["by_engine"].items()},
        "route_reasons": reasons,
        "worker_load": workers,
    }


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _headline(results: dict) -> dict:
    """The two figures of the target: duet's goodput over the better homogeneous stack's, and duet's
    long-document TTFT p99 over the all-paged stack's (None when a configuration was not run)."""
    duet = results.get("duet")
    homogeneous = [results[c]["goodput_rps"] for c in ("paged_round_robin", "prefix_cache_aware") if c in results]
    paged = results.get("paged_round_robin")

    def doc_p99(r):
        return r["classes"].get("long_doc", {}).get("ttft_p99_ms") if r else None

    ratio = _ratio(duet["goodput_rps"], max(homogeneous)) if duet and homogeneous else None
    doc = _ratio(doc_p99(duet), doc_p99(paged)) if duet and paged else None
    return {"goodput_ratio_vs_best_homogeneous": ratio, "long_doc_ttft_p99_ratio_vs_paged": doc,
            "target_met": None if ratio is None or doc is None else (ratio >= 1.2 and doc <= 1.0)}


def run(s: Settings, log_dir: Path | None = None, progress=None) -> dict:
    """The whole experiment; `progress(str)` hears one line per configuration."""
    s.validate()
    model = Path(s.model).expanduser().resolve() if s.model else bench_checkpoint()
    if not (model / "config.json").is_file():
        raise CompareError(f"--model {model}: not a model directory (no config.json)")
    from duet.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    requests = workload(model, s)
    t0 = time.monotonic()
    results = {}
    for name in s.configs:
        sub = None if log_dir is None else Path(log_dir) / name
        if sub is not None:
            sub.mkdir(parents=True, exist_ok=True)
        results[name] = run_config(name, model, requests, s, tokenizer.encode, sub)
        if progress is not None:
            r = results[name]
            progress(f"{name}: goodput {r['goodput_rps']:.3f} req/s, {r['num_good']}/{r['num_requests']} good, "
                     f"{r['num_errors']} errors, {r['duration_s']:.0f} s")
    settings = asdict(replace(s, model=str(model)))
    settings["configs"] = list(s.configs)
    return {
        "model": model.name, "device": "cpu", "cpu_count": os.cpu_count(),
        "workload": {"classes": SHARES, "num_requests": len(requests),
                     "conversations_and_documents": sum(1 for r in requests if r.depends_on is None)},
        "slo": {"ttft_ms": s.ttft_slo_ms, "itl_ms": s.itl_slo_ms}, "settings": settings,
        "configs": results, **_headline(results), "wall_s": round(time.monotonic() - t0, 1),
    }


def _f(x, digits=0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(result: dict) -> str:
    slo = result["slo"]
    title = (f"duet bench compare: {result['workload']['num_requests']} requests on {result['model']} (cpu), "
             f"SLO: TTFT <= {slo['ttft_ms']:.0f} ms and TPOT <= {slo['itl_ms']:.0f} ms")
    lines = [title, ""]
    classes = sorted({c for r in result["configs"].values() for c in r["classes"]})
    head = ["config", "goodput req/s", "good/all", "req/s"] + [f"{c} TTFT p50/p99 ms" for c in classes]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in result["configs"].items():
        cells = [name, _f(r["goodput_rps"], 3), f"{r['num_good']}/{r['num_requests']}", _f(r["request_throughput_rps"], 3)]
        for c in classes:
            g = r["classes"].get(c)
            cells.append("-" if g is None else f"{_f(g['ttft_p50_ms'])} / {_f(g['ttft_p99_ms'])}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, r in result["configs"].items():
        loads = ", ".join(f"{w} ({v['engine']}): {v['requests']} req, mean load {_f(v['mean_load'], 1)}, "
                          f"max waiting {v['max_waiting']}, prefix hit {_f(v['prefix_hit_rate'], 2)}"
                          for w, v in r["worker_load"].items())
        reasons = "; ".join(f"{c}: " + ", ".join(f"{k} {n}" for k, n in sorted(v.items()))
                            for c, v in sorted(r["route_reasons"].items()))
        lines.append(f"{name}: {loads}\n  route reasons: {reasons}")
        if r["errors"]:
            lines.append(f"  errors: {r['errors']}")
    lines.append("")
    lines.append(f"goodput_ratio_vs_best_homogeneous: {_f(result['goodput_ratio_vs_best_homogeneous'], 3)} (target >= 1.2)")
    lines.append(f"long_doc_ttft_p99_ratio_vs_paged: {_f(result['long_doc_ttft_p99_ratio_vs_paged'], 3)} (target <= 1.0)")
    return "\n".join(lines)
