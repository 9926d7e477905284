"""`duet bench compare`: the headline experiment — which engine, for which traffic?

The same mixed workload (multi-turn chat sessions, agent loops and unrelated long documents, in
equal shares of the requests by default, `--mix` for others; Poisson arrivals of conversations and
documents, open loop, seeded) runs against four stacks of the same size on the same checkpoint:

    all_paged     every worker engine_paged (prefix caching on where the engine has it:
                  loadtests.stack.serving.paged_prefix_caching_flags), behind the SGLang-style cache-aware
                  policy (loadtests/sim/routing/baselines.py) - the vLLM deployment users run today
    all_prefix    every worker engine_prefix, behind the SGLang-style cache-aware policy
    duet_fixed    half engine_paged, half engine_prefix, the gateway's own routing
    duet_planner  starts as duet_fixed; the gateway's pool planner sets the split and a pool manager
                  (duet/pool_manager.py, in a thread of this process) switches workers' kinds

All go through the real gateway (its config's `routing_policy` runs the baseline in place of Duet's
routing, the same `sglang_cache_aware` policy `duet bench simulate-routing` replays) and real engine workers with
identical limits (`loadtests.stack.serving.EngineLimits`, one torch thread per worker), one after the other, at each of
three rates, with repeats, on a random checkpoint of SmolLM2-135M's shape (the shape sets the timing).

Calibrated on the quiet 2-core machine (docs/benchmarks.md, "How rates, SLOs and the KV budget were
chosen"): at light load a request's TTFT is 0.4 s (agent) to 2.8 s (a long document, 3.6 s at most) and its
TPOT 58 ms; a burst of the mix is served at 0.69 requests/s, about 0.35 arrivals/s (an arrival is a
conversation or a document; a conversation brings four requests). Rates, in arrivals/s: light 0.15 (under half
of that), medium 0.30 (near it: loaded, not saturated), heavy 0.45 (1.3x it: the queues grow). SLOs, the same
for every stack: TTFT <= 5 s (an unqueued document meets it; one queued behind another document's prefill
does not) and TPOT <= 250 ms (about 4x the unloaded TPOT: a request may share its steps with one document's
prefill, not several).

KV budget 4,096 tokens per worker: three 1,024-token requests running plus the shared heads. On this machine a
worker takes in about 60 new tokens/s at the medium rate (estimated from the workload's sizes, not measured),
so its cache turns over in about a minute - longer than the few seconds between two turns of a session. The
budget would have to be smaller than one document for documents to evict live sessions' prefixes here, so
what isolating documents buys on this machine is compute (no session turn queued behind a document's
prefill), not cache. The request count per run is what arrives at the rate in `run_seconds` (120 s);
`duet bench compare --json` with no options runs the headline: every rate, three repeats at medium and one at
light and heavy.

`--pin-cores` (loadtests/stack/pinning.py) pins worker i of every stack to core i (two workers on this
machine: 2 paged, 2 prefix, 1 + 1) and judges goodput by per-class SLOs (duet/traffic_classes.py, the cpu
profile: a chat turn must start within 2 s, a document within 4 s + 4 ms a prompt token) instead of one bound for
all.

Per stack and rate: goodput (requests meeting both the TTFT and the TPOT SLO, per second), TTFT per
class, engine and route-reason split, worker loads; `goodput_ratio_vs_best_homogeneous` and
`long_doc_ttft_p99_ratio_vs_paged` with their median, min and max over the repeats.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from duet.model_pull import resolve_model
from duet.traffic_classes import UNCLASSIFIED
from loadtests.experiments.compare_report import headline, rate_summary
from loadtests.load.class_slo import ClassSlo
from loadtests.load.client import RequestRecord, arun_benchmark
from loadtests.load.report import Slo, summarize
from loadtests.load.workloads import SESSION_TURNS, BenchRequest, TokenSource, mix
from loadtests.sim.routing.baselines import SGLANG_ROUTING_POLICY
from loadtests.stack.pinning import core_plan
from loadtests.stack.serving import EngineLimits, ServingStack, paged_prefix_caching_flags, preset_checkpoint

CONFIGS = {
    # name: (engine kinds of the workers, given the worker count; routing policy; pool planner on)
    "all_paged": (lambda n: ["paged"] * n, "sglang_cache_aware", False),
    "all_prefix": (lambda n: ["prefix"] * n, "sglang_cache_aware", False),
    "duet_fixed": (lambda n: ["paged"] * (n // 2) + ["prefix"] * (n - n // 2), "duet", False),
    "duet_planner": (lambda n: ["paged"] * (n // 2) + ["prefix"] * (n - n // 2), "duet", True),
}
SHARES = {"multi_turn": 1.0, "agent": 1.0, "long_doc": 1.0}
RATES = {"light": 0.15, "medium": 0.30, "heavy": 0.45}  # arrivals/s (module docstring)
HEADLINE_REPEATS = {"light": 1, "medium": 3, "heavy": 1}
# the planner at the gateway's defaults (rates over 30 s, at most one change every 30 s): with 20 s / 15 s, a
# window held about four documents at the medium rate, and the split followed their Poisson noise
PLANNER = {"window_s": 30.0, "cooldown_s": 30.0}


def gateway_policy(policy: str) -> dict:
    """The gateway config keys that run `policy` ("duet": none, the gateway's own routing)."""
    return {} if policy == "duet" else {"routing_policy": SGLANG_ROUTING_POLICY}


class CompareError(ValueError):
    """Settings that cannot make the experiment (the message names the setting)."""


@dataclass(frozen=True)
class Settings:
    """One experiment. The defaults are the headline run (module docstring: how the rates, SLOs and KV
    budget were chosen); QUICK is a small one for checking the machinery."""

    model: str | None = None  # None: a random checkpoint of `preset`, made once in the cache dir
    preset: str = "smollm2"  # SmolLM2-135M's shape (duet/model_make.py presets)
    workers: int = 4
    num_requests: int | None = None  # None: rate x run_seconds
    run_seconds: float = 120.0
    rates: tuple[str, ...] = tuple(RATES)  # names of RATES, or numbers as strings
    repeats: int | None = None  # None: HEADLINE_REPEATS; N: N at every rate
    max_prompt_tokens: int = 1024
    max_tokens: int = 32
    seed: int = 0
    ttft_slo_ms: float = UNCLASSIFIED.ttft_ms  # one bound for every class: duet/traffic_classes.py, 5 s
    itl_slo_ms: float = UNCLASSIFIED.itl_ms  # bound on each request's mean inter-token latency (TPOT), 250 ms
    limits: EngineLimits = field(default_factory=lambda: EngineLimits(kv_cache_tokens=4096))
    configs: tuple[str, ...] = tuple(CONFIGS)
    shares: tuple[tuple[str, float], ...] = tuple(SHARES.items())
    ready_timeout_s: float = 300.0
    pin_cores: bool = False  # worker i on core i (pinning.py)
    class_slo: ClassSlo | None = None  # per-class SLOs instead of ttft_slo_ms / itl_slo_ms for every class

    def rate_value(self, name: str) -> float:
        try:
            return RATES[name] if name in RATES else float(name)
        except ValueError:
            raise CompareError(f"--rates: {name!r} is neither light/medium/heavy nor a number") from None

    def repeats_at(self, name: str) -> int:
        return self.repeats if self.repeats is not None else HEADLINE_REPEATS.get(name, 1)

    def validate(self) -> Settings:
        if self.workers < 2:
            raise CompareError(f"--workers must be at least 2 (duet needs one engine of each kind), got {self.workers}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise CompareError(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
        if not self.rates or not all(self.rate_value(r) > 0 for r in self.rates):
            raise CompareError("--rates must be positive")
        if self.repeats is not None and self.repeats < 1:
            raise CompareError(f"--repeats must be >= 1, got {self.repeats}")
        if self.pin_cores:
            core_plan(self.workers)  # PinError (a ValueError) when the machine has too few cores
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise CompareError("--slo-ttft-ms and --slo-itl-ms must be positive")
        bad = [k for k, v in self.shares if k not in SHARES or v < 0]
        if bad or not any(v > 0 for _, v in self.shares):
            raise CompareError(f"--mix: classes are {', '.join(SHARES)} with shares >= 0 (one positive); got {bad}")
        return self


QUICK = Settings(preset="bench", workers=2, num_requests=24, rates=("light",), repeats=1, max_prompt_tokens=512,
                 max_tokens=16)


def requests_for(s: Settings, rate: float) -> int:
    """Requests whose chains (a session or a document) arrive at `rate` per second for `run_seconds`:
    a session's later turns follow its first, so only first turns and documents are arrivals."""
    shares = dict(s.shares)
    total = sum(shares.values())
    arrivals_per_request = (shares.get("long_doc", 0.0)
                            + (shares.get("multi_turn", 0.0) + shares.get("agent", 0.0)) / SESSION_TURNS) / total
    return max(12, round(rate * s.run_seconds / arrivals_per_request))


def workload(model: Path, s: Settings, rate: float) -> list[BenchRequest]:
    src = TokenSource.from_model_dir(model)
    n = s.num_requests or requests_for(s, rate)
    return mix(src, n, s.max_prompt_tokens, s.max_tokens, s.seed, dict(s.shares))


async def _sample_load(stack: ServingStack, samples: dict[str, list[tuple[int, int]]], stop: asyncio.Event) -> None:
    """(running, waiting) per worker, twice a second, as the gateway sees it (GetLoad polling)."""
    while not stop.is_set():
        for row in await asyncio.to_thread(stack.workers):
            samples.setdefault(row["worker_id"], []).append((row["num_running"], row["num_waiting"]))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def _measure(stack: ServingStack, model_id: str, requests, encode, s: Settings, rate: float):
    samples: dict[str, list[tuple[int, int]]] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_load(stack, samples, stop))
    try:
        records = await arun_benchmark(stack.url, model_id, requests, rate=rate, encode=encode,
                                       progress=False, seed=s.seed)
    finally:
        stop.set()
        await sampler
    return records, samples


def slo_of(s: Settings) -> Slo | ClassSlo:
    return s.class_slo if s.class_slo is not None else Slo(ttft_ms=s.ttft_slo_ms, itl_ms=s.itl_slo_ms)


def stack_for(name: str, model: Path, s: Settings, log_dir: Path | None = None) -> ServingStack:
    """The stack of configuration `name` (not started: `with` starts it)."""
    kinds_of, policy, planner = CONFIGS[name]
    kinds = kinds_of(s.workers)
    return ServingStack(model, kinds, {}, s.limits, s.ready_timeout_s, log_dir, gateway_extra=gateway_policy(policy),
                        pool_planner=PLANNER if planner else None, cpus=core_plan(len(kinds)) if s.pin_cores else None)


def run_config(name: str, model: Path, requests: list[BenchRequest], s: Settings, encode, rate: float,
               log_dir: Path | None = None) -> dict:
    _, policy, planner = CONFIGS[name]
    t0 = time.monotonic()
    with stack_for(name, model, s, log_dir) as stack:
        kinds = stack.kinds
        started_s = time.monotonic() - t0
        done = threading.Event()
        manager = stack.pool_manager(done.is_set) if planner else None
        # the manager waits on the gateway's admin API, so a thread of its own; it starts processes
        # only through duet.up.Stack, and nothing else here forks while it runs
        thread = threading.Thread(target=manager.run, daemon=True) if manager else None
        if thread:
            thread.start()
        try:
            records, samples = asyncio.run(_measure(stack, model.name, requests, encode, s, rate))
        finally:
            done.set()
            if thread:
                thread.join(timeout=s.ready_timeout_s)
        final = {row["worker_id"]: row for row in stack.workers()}
        kinds_after = [row["engine_kind"] for row in final.values()]
    result = _config_result(name, kinds, policy, records, samples, final, s, started_s)
    if manager:
        result["switches"] = [{"t": t, "from": old, "to": new, "kind": k} for t, old, new, k in manager.switches]
        result["workers_after"] = {k: kinds_after.count(k) for k in ("paged", "prefix")}
    return result


def _config_result(name: str, kinds: list[str], policy: str, records: list[RequestRecord],
                   samples: dict, final: dict, s: Settings, started_s: float) -> dict:
    summary = summarize(records, slo_of(s))

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


def bench_model_dir(model: str | None, preset: str) -> Path:
    """A benchmark's --model as a Hugging Face directory: a directory, a .gguf file or a pullable name, as the
    engines take it (duet.model_pull.resolve_model); the preset's random checkpoint when not given."""
    path = resolve_model(model) if model else preset_checkpoint(preset)
    if not (path / "config.json").is_file():
        raise CompareError(f"--model {model}: not a model directory (no config.json)")
    return path


def run(s: Settings, log_dir: Path | None = None, progress=None) -> dict:
    """The whole experiment; `progress(str)` hears one line per run."""
    s.validate()
    model = bench_model_dir(s.model, s.preset)
    from duet.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    t0 = time.monotonic()
    rates = {}
    for rate_name in s.rates:
        rate = s.rate_value(rate_name)
        requests = workload(model, s, rate)
        runs: dict[str, list[dict]] = {c: [] for c in s.configs}
        for rep in range(s.repeats_at(rate_name)):
            for name in s.configs:  # repeats interleave the stacks: drift in the machine hits all alike
                sub = None if log_dir is None else Path(log_dir) / f"{rate_name}-{rep}-{name}"
                if sub is not None:
                    sub.mkdir(parents=True, exist_ok=True)
                r = run_config(name, model, requests, s, tokenizer.encode, rate, sub)
                runs[name].append(r)
                if progress is not None:
                    progress(f"{rate_name} ({rate} /s) #{rep + 1} {name}: goodput {r['goodput_rps']:.3f} req/s, "
                             f"{r['num_good']}/{r['num_requests']} good, {r['num_errors']} errors, "
                             f"{r['duration_s']:.0f} s")
        rates[rate_name] = {"rate": rate, "num_requests": len(requests), "runs": runs, "summary": rate_summary(runs)}
    settings = asdict(replace(s, model=str(model)))
    settings["configs"], settings["rates"] = list(s.configs), list(s.rates)
    return {
        "model": model.name, "device": "cpu", "cpu_count": os.cpu_count(),
        "paged_prefix_caching": bool(paged_prefix_caching_flags()) and s.limits.paged_prefix_caching,
        "workload": {"classes": dict(s.shares)}, "kv_cache_tokens_per_worker": s.limits.kv_cache_tokens,
        "slo": _slo_report(s), "pinned_cores": core_plan(s.workers) if s.pin_cores else None, "settings": settings,
        "rates": rates, **headline(rates), "wall_s": round(time.monotonic() - t0, 1),
    }


def _slo_report(s: Settings) -> dict:
    if s.class_slo is None:
        return {"ttft_ms": s.ttft_slo_ms, "itl_ms": s.itl_slo_ms}
    return {"per_class": s.class_slo.describe(dict(s.shares))}
