"""`duet bench classes`: what each engine kind is better at, measured one kind and one class at a time.

For each engine kind (paged, prefix) and each workload - every traffic class of
loadtests/load/class_workloads.py alone (long_doc, multi_turn, agent, structured, copy_edit) and all of them
mixed - one fresh stack: ONE worker of that kind pinned to one core (`--core`, taskset through
duet/launcher.py) behind a gateway pinned elsewhere (`--gateway-cores`), so the engine's compute is its own.

Each run first measures the worker's capacity on that workload: a burst of `calib_requests` requests (another
seed: other prompts and heads, so the cache learns nothing the measured run reuses; think times dropped)
sent at once, completed requests per second. Then the measured run: Poisson arrivals at `load` x that capacity
(`--load`, default 0.9: near capacity, loaded but not collapsing), or at `--rate` arrivals/s for every run
alike. A class the kind cannot serve (structured output on paged) is reported as unsupported, not run, and
left out of that kind's mix.

Per run and per class: goodput against per-class SLOs (duet/traffic_classes.py, cpu profile), TTFT and TPOT
p50 / p99, the hit rate (cached / prompt tokens, as the engine reported them to the client), and per run the worker's
preemptions and evictions of reused KV pages (GetLoad's counters through the gateway's /admin/workers,
after minus before the measured run). `--engine-args KIND="FLAGS"` passes flags to the workers of a kind
(e.g. prefix="--cache-eviction lru" measures the old eviction rule against the new default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from duet.contract import ENGINE_KINDS as KINDS
from loadtests.load.class_slo import ClassSlo
from loadtests.load.class_workloads import CLASSES, PREFIX_ONLY, QUICK_SIZES, Sizes, class_mix, class_workload
from loadtests.load.client import arun_benchmark
from loadtests.load.report import summarize
from loadtests.load.workloads import BenchRequest, TokenSource
from loadtests.stack.serving import EngineLimits, ServingStack

WORKLOADS = (*CLASSES, "mixed")
COUNTERS = ("num_preemptions", "reused_pages_evicted")


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # None: a random checkpoint of `preset` (loadtests.stack.serving.preset_checkpoint)
    preset: str = "smollm2"
    kinds: tuple[str, ...] = KINDS
    workloads: tuple[str, ...] = WORKLOADS
    num_requests: int = 40  # per measured run
    calib_requests: int = 12
    load: float = 0.9  # the measured run's arrival rate, as a fraction of the capacity burst's
    rate: float | None = None  # arrivals/s for every run instead (comparable offered load)
    core: str = "0"
    gateway_cores: str | None = "1"  # None: unpinned
    think_scale: float = 0.05
    seed: int = 0
    sizes: Sizes = field(default_factory=Sizes)
    limits: EngineLimits = field(default_factory=lambda: EngineLimits(kv_cache_tokens=8192))
    slo: ClassSlo = field(default_factory=ClassSlo)
    engine_args: tuple[tuple[str, str], ...] = ()  # (kind, flags)
    ready_timeout_s: float = 300.0

    def validate(self) -> Settings:
        bad = [k for k in self.kinds if k not in KINDS] + [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.kinds or not self.workloads:
            raise ValueError(f"unknown kinds or workloads {bad}: kinds are {', '.join(KINDS)}, workloads "
                             f"{', '.join(WORKLOADS)}")
        if self.num_requests < 1 or self.calib_requests < 1:
            raise ValueError("--num-requests and --calib-requests must be at least 1")
        if not 0 < self.load <= 2 or (self.rate is not None and not self.rate > 0):
            raise ValueError("--load must be in (0, 2] and --rate positive")
        return self


QUICK = Settings(preset="bench", num_requests=10, calib_requests=4, sizes=QUICK_SIZES,
                 limits=EngineLimits(kv_cache_tokens=4096))


def servable(kind: str) -> tuple[str, ...]:
    """The classes a kind serves (the paged engine has no structured output)."""
    return tuple(c for c in CLASSES if kind != "paged" or c not in PREFIX_ONLY)


def build(name: str, src: TokenSource, n: int, seed: int, s: Settings, gaps: list[float],
          kind: str = "prefix") -> list[BenchRequest]:
    if name == "mixed":
        return class_mix(src, n, seed, s.sizes, gaps, s.think_scale, classes=servable(kind))
    return class_workload(name, src, n, seed, s.sizes, gaps, s.think_scale)


def chains_per_request(requests: list[BenchRequest]) -> float:
    """Arrivals (first turns and one-shot requests) per request: a rate of requests to one of arrivals."""
    return sum(1 for r in requests if r.depends_on is None) / len(requests)


def counters(stack: ServingStack) -> dict[str, int]:
    rows = stack.workers()
    return {c: sum(int(r[c]) for r in rows) for c in COUNTERS}  # a gateway without them is an error


async def _calibrate(stack: ServingStack, model_id: str, requests: list[BenchRequest], encode) -> float:
    """Completed requests per second of a burst (all sent at once, think times dropped)."""
    burst = [dataclasses.replace(r, think_s=0.0) for r in requests]
    records = await arun_benchmark(stack.url, model_id, burst, rate=float("inf"), encode=encode, progress=False)
    ok = [r for r in records if r.ok]
    span = max((r.end_s for r in ok), default=0.0) - min((r.start_s for r in records), default=0.0)
    return len(ok) / span if span > 0 else 0.0


def _class_row(g: dict, bound: dict) -> dict:
    return {"num_requests": g["num_requests"], "num_errors": g["num_errors"], "num_good": g["num_good"],
            "goodput_rps": g["goodput_rps"], "ttft_p50_ms": g["ttft_ms"]["p50"], "ttft_p99_ms": g["ttft_ms"]["p99"],
            "tpot_p50_ms": g["tpot_ms"]["p50"], "tpot_p99_ms": g["tpot_ms"]["p99"],
            "hit_rate": g["cached_token_ratio"], "slo": bound}


def _request_row(r) -> dict:
    """One request of a run, for reading a tail back to its cause: when it came, what it asked, what it got."""
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    return {"class": r.traffic_class, "start_s": round(r.start_s, 3), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft_s),
            "tpot_ms": ms(r.tpot_s), "itl_max_ms": ms(max(r.itl_s, default=None)), "error": r.error}


def run_one(kind: str, workload: str, model: Path, s: Settings, src: TokenSource, encode, gaps: list[float],
            log_dir: Path | None = None) -> dict:
    requests = build(workload, src, s.num_requests, s.seed, s, gaps, kind)
    calib = build(workload, src, s.calib_requests, s.seed + 1000, s, gaps, kind)
    extra = {k: tuple(shlex.split(v)) for k, v in s.engine_args}
    with ServingStack(model, [kind], {}, s.limits, s.ready_timeout_s, log_dir, cpus=[s.core],
                      gateway_cpus=s.gateway_cores, worker_args=extra) as stack:
        capacity = asyncio.run(_calibrate(stack, model.name, calib, encode))
        if s.rate is not None:
            rate = s.rate
        else:  # arrivals/s whose requests come at load x capacity
            rate = max(1e-3, s.load * capacity * chains_per_request(requests))
        before = counters(stack)
        records = asyncio.run(arun_benchmark(stack.url, model.name, requests, rate=rate, encode=encode,
                                             progress=False, seed=s.seed))
        after = counters(stack)
    summary = summarize(records, s.slo)
    return {"kind": kind, "workload": workload, "capacity_rps": capacity, "rate_arrivals_per_s": rate,
            "num_requests": summary["num_requests"], "num_good": summary["num_good"],
            "num_errors": summary["num_errors"], "errors": summary["errors"], "goodput_rps": summary["goodput_rps"],
            "duration_s": summary["duration_s"], **{c: after[c] - before[c] for c in COUNTERS},
            # over every request of the run (a mixed run's tails: does one class's prefill stretch the others?)
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "itl_p50_ms": summary["itl_ms"]["p50"], "itl_p99_ms": summary["itl_ms"]["p99"],
            "classes": {c: _class_row(g, s.slo.bound(c).describe()) for c, g in summary["by_class"].items()},
            "requests": [_request_row(r) for r in records]}


def run(s: Settings, log_dir: Path | None = None, progress=None) -> dict:
    s.validate()
    from duet.tokenizer import Tokenizer
    from loadtests.experiments.compare import bench_model_dir
    from loadtests.load.class_workloads import mooncake_think_gaps

    model = bench_model_dir(s.model, s.preset)
    src, encode = TokenSource.from_model_dir(model), Tokenizer.from_dir(model).encode
    gaps = mooncake_think_gaps() if "multi_turn" in s.workloads or "mixed" in s.workloads else []
    t0 = time.monotonic()
    runs: dict[str, dict[str, dict]] = {}
    for kind in s.kinds:
        for w in s.workloads:
            if w != "mixed" and w not in servable(kind):
                runs.setdefault(kind, {})[w] = {"kind": kind, "workload": w, "unsupported": True}
                continue
            sub = None if log_dir is None else Path(log_dir) / f"{kind}-{w}"
            r = run_one(kind, w, model, s, src, encode, gaps, sub)  # mixed: the classes the kind serves
            runs.setdefault(kind, {})[w] = r
            if progress is not None:
                progress(f"{kind} {w}: capacity {r['capacity_rps']:.2f} req/s, rate {r['rate_arrivals_per_s']:.3f} "
                         f"arrivals/s, goodput {r['goodput_rps']:.3f} req/s, {r['num_good']}/{r['num_requests']} good, "
                         f"{r['num_preemptions']} preemptions, {r['reused_pages_evicted']} reused pages evicted")
    return {"model": model.name, "cpu_count": os.cpu_count(), "core": s.core, "gateway_cores": s.gateway_cores,
            "engine_args": dict(s.engine_args), "kv_cache_tokens": s.limits.kv_cache_tokens,
            "load": s.load if s.rate is None else None, "rate": s.rate, "think_scale": s.think_scale,
            "sizes": dataclasses.asdict(s.sizes), "runs": runs, "wall_s": round(time.monotonic() - t0, 1)}


def _f(x, d=0) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def format_table(result: dict) -> str:
    head = ["kind", "workload", "class", "goodput req/s", "good/n", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "hit rate", "preempt.", "reused evicted"]
    title = (f"duet bench classes on {result['model']}: one worker on core {result['core']}, KV "
             f"{result['kv_cache_tokens']} tokens; ms; per-class SLOs (duet/traffic_classes.py, cpu profile)")
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind, by_w in result["runs"].items():
        for w, r in by_w.items():
            if r.get("unsupported"):
                lines.append(f"| {kind} | {w} | - | unsupported |" + " |" * (len(head) - 4))
                continue
            for c, g in r["classes"].items():
                lines.append(f"| {kind} | {w} | {c} | {_f(g['goodput_rps'], 3)} | {g['num_good']}/{g['num_requests']} | "
                             f"{_f(g['ttft_p50_ms'])} | {_f(g['ttft_p99_ms'])} | {_f(g['tpot_p50_ms'])} | "
                             f"{_f(g['tpot_p99_ms'])} | {_f(g['hit_rate'], 2)} | {r['num_preemptions']} | "
                             f"{r['reused_pages_evicted']} |")
    return "\n".join(lines)
