"""`duet bench advise --trace FILE`: paged, prefix, or both (and in what split), for this traffic?

Replays a team's own trace (Mooncake JSONL, Azure CSV or an OpenAI request log: loadtests/traces/formats.py)
against the three deployments and recommends one, with the figures behind it:

    all_paged    N engine_paged workers, the SGLang-style cache-aware routing (loadtests/sim/routing/baselines.py)
    all_prefix   N engine_prefix workers, the SGLang-style cache-aware routing
    duet         k engine_paged + (N - k) engine_prefix behind Duet's routing, for every k in 1..N-1

`--simulate` replays it in the routing simulator (loadtests/sim/routing/simulate.py: per-worker LRU block
caches, FIFO prefill, batched decode; seconds for a whole trace). The simulated engines differ only in
the kind routing sees, so there the comparison measures what routing by kind does to caches and
queues (documents kept off the session workers' caches, sessions kept together); all_paged and
all_prefix come out alike, and the choice between them falls to the trace's reuse: prefix when more
than `PREFIX_REUSE` of its prompt tokens repeat an earlier prompt's prefix (radix caching and
cache-aware scheduling pay), paged otherwise. Without --simulate each deployment runs for real on
this machine (`duet bench compare`'s stacks, the first `--limit` records, the split Duet's
simulation found best), so the engines' own differences count too.

Recommendation: Duet with the best split when its goodput (requests whose TTFT meets the SLO, per
second) beats the better homogeneous deployment's by more than `MARGIN` and its TTFT p99 is no worse;
else the better homogeneous deployment (by goodput, then TTFT p99; ties by the reuse rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loadtests.sim.routing.baselines import SGLangCacheAware
from loadtests.sim.routing.simulate import DuetPolicy, ServiceModel, global_cache_hit_rate, simulate
from loadtests.traces.mooncake import TraceRecord

MARGIN = 0.05  # duet must beat the better homogeneous stack's goodput by 5% to be worth two engine kinds
PREFIX_REUSE = 0.10  # token share repeating an earlier prefix above which prefix caching is the better bet


@dataclass(frozen=True)
class AdviseSettings:
    workers: int = 8
    cache_blocks: int = 2048  # per worker, in 512-token trace blocks
    time_scale: float = 1.0
    slo_ttft_s: float = 2.0
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
    """Every deployment in the simulator: {name: result}, duet under `duet_k` for each split, and
    `prefix_duet_routing` (one kind behind Duet's routing: what the routing alone is worth; shown, not
    recommended from)."""
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


def _key(r: dict) -> tuple[float, float]:
    return (r["goodput_rps"], -r["ttft_p99_s"])


def recommend(results: dict, reuse: float) -> dict:
    """The recommendation and the figures it rests on (module docstring)."""
    duets = {k: v for k, v in results.items() if k.startswith("duet_")}
    best_duet = max(duets, key=lambda k: _key(duets[k]))
    homogeneous = {k: results[k] for k in ("all_paged", "all_prefix") if k in results}
    by_reuse = "all_prefix" if reuse > PREFIX_REUSE else "all_paged"
    best_homo = max(homogeneous, key=lambda k: (_key(homogeneous[k]), k == by_reuse))
    d, h = results[best_duet], results[best_homo]
    if h["goodput_rps"] > 0:
        gain = d["goodput_rps"] / h["goodput_rps"]
    else:  # nothing met the SLO on the homogeneous stack: any goodput is a clear win, none is a tie
        gain = float("inf") if d["goodput_rps"] > 0 else 1.0
    if gain > 1 + MARGIN and d["ttft_p99_s"] <= h["ttft_p99_s"]:
        w = d["workers"]
        choice, why = "both", (f"Duet with {w['paged']} paged + {w['prefix']} prefix serves {gain:.2f}x the goodput "
                               f"of {best_homo} at TTFT p99 {d['ttft_p99_s']:.2f} s against {h['ttft_p99_s']:.2f} s")
        split = w
    else:
        choice = "prefix" if best_homo == "all_prefix" else "paged"
        split = homogeneous[best_homo]["workers"]
        why = (f"{best_homo} is within {MARGIN:.0%} of the best Duet split's goodput ({gain:.2f}x) or has the "
               f"lower TTFT p99; {reuse:.0%} of the trace's prompt blocks repeat an earlier prefix")
    routing_only = results.get("prefix_duet_routing")
    if choice == "both" and routing_only is not None and _key(routing_only) >= _key(d):
        # the simulated engines are alike: what won is Duet's routing, which one kind behind it gets too
        why += ("; in this simulation one engine kind behind Duet's routing does as well "
                f"({routing_only['goodput_rps']:.3f} req/s), so the gain is the routing's, and whether a second "
                "kind adds to it is for a local replay (without --simulate) to show")
    return {"engine": choice, "split": split, "best_duet": best_duet, "best_homogeneous": best_homo,
            "goodput_ratio_duet_vs_best_homogeneous": round(gain, 3), "reuse_share": round(reuse, 4), "why": why}


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


def advise_local(trace: str, s: AdviseSettings, model: str | None = None, max_prompt_tokens: int = 1024,
                 max_tokens: int = 32, log_dir: Path | None = None, progress=None) -> dict:
    """Each deployment for real on this machine (the first `s.limit` records, default 200; prompts cut
    to `max_prompt_tokens`, outputs to `max_tokens`, so a CPU replays them), Duet with the split the
    simulation finds best. The same engines, limits and gateway as `duet bench compare`."""
    import asyncio

    from duet.tokenizer import Tokenizer
    from loadtests.experiments import compare
    from loadtests.load.report import Slo, summarize
    from loadtests.load.workloads import BenchRequest, TokenSource
    from loadtests.stack.serving import ServingStack, preset_checkpoint
    from loadtests.traces.formats import detect_format, load_any

    s.validate()
    records = load_any(trace)[: s.limit or 200]
    simulated = simulate_all(records, s)
    reuse = reuse_share(records)
    split = simulated[recommend(simulated, reuse)["best_duet"]]["workers"]
    model_dir = Path(model).expanduser().resolve() if model else preset_checkpoint("bench")
    src = TokenSource.from_model_dir(model_dir)
    t0 = records[0].timestamp_ms
    requests = []
    for i, rec in enumerate(records):
        ids: list[int] = []
        for h in rec.hash_ids:  # each block id is a fixed run of tokens: shared prefixes stay shared
            ids += src.block(h)
            if len(ids) >= min(rec.input_length, max_prompt_tokens):
                break
        requests.append(BenchRequest(f"trace-{i}", "trace", tuple(ids[:min(rec.input_length, max_prompt_tokens)]),
                                     max(1, min(rec.output_length, max_tokens)),
                                     arrival_s=(rec.timestamp_ms - t0) / 1000.0 * s.time_scale,
                                     session_id=_session(rec)))
    encode = Tokenizer.from_dir(model_dir).encode
    slo = Slo(ttft_ms=1000 * s.slo_ttft_s, itl_ms=compare.Settings().itl_slo_ms)
    stacks = {"all_paged": (["paged"] * s.workers, "sglang_cache_aware"),
              "all_prefix": (["prefix"] * s.workers, "sglang_cache_aware"),
              f"duet_{split['paged']}": (["paged"] * split["paged"] + ["prefix"] * split["prefix"], "duet")}
    results = {}
    for name, (kinds, policy) in stacks.items():
        sub = None if log_dir is None else Path(log_dir) / name
        if sub is not None:
            sub.mkdir(parents=True, exist_ok=True)
        with ServingStack(model_dir, kinds, {}, compare.Settings().limits, 300.0, sub,
                          gateway_extra=compare.gateway_policy(policy)) as stack:
            recs = asyncio.run(arun_open_loop(stack.url, model_dir.name, requests, encode))
        summary = summarize(recs, slo)
        results[name] = {"workers": {"paged": kinds.count("paged"), "prefix": kinds.count("prefix")},
                         "goodput_rps": summary["goodput_rps"], "slo_attainment":
                         summary["num_good"] / max(1, summary["num_requests"]),
                         "ttft_p50_s": (summary["ttft_ms"]["p50"] or 0) / 1000,
                         "ttft_p99_s": (summary["ttft_ms"]["p99"] or 0) / 1000,
                         "num_errors": summary["num_errors"]}
        if progress is not None:
            progress(f"{name}: goodput {results[name]['goodput_rps']:.3f} req/s, {summary['num_errors']} errors")
    return {"trace": str(trace), "format": detect_format(trace), "records": len(records), "mode": "local replay",
            "settings": {"workers": s.workers, "slo_ttft_s": s.slo_ttft_s, "time_scale": s.time_scale,
                         "model": model_dir.name}, "stacks": results, "simulated": simulated,
            "recommendation": recommend(results, reuse)}


async def arun_open_loop(url: str, model: str, requests, encode):
    from loadtests.load.client import arun_benchmark

    return await arun_benchmark(url, model, requests, encode=encode, progress=False)


def _session(rec: TraceRecord) -> str | None:
    from loadtests.traces.mooncake import session_key

    return session_key(rec)


def format_markdown(result: dict) -> str:
    rec = result["recommendation"]
    st = result["settings"]
    lines = [f"# duet bench advise: {Path(result['trace']).name}", "",
             f"{result['records']} requests ({result['format']}), {result['mode']}, {st['workers']} workers"
             + (f" x {st['cache_blocks']} blocks" if "cache_blocks" in st else "")
             + f", TTFT SLO {st['slo_ttft_s']} s", "",
             (f"**Recommendation: {rec['engine']}** "
              f"({rec['split']['paged']} paged + {rec['split']['prefix']} prefix). {rec['why']}."), "",
             "| deployment | paged + prefix | goodput req/s | SLO met | hit rate | TTFT p50 s | TTFT p99 s | load max/mean |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result["stacks"].items():
        w = r["workers"]
        hit, balance = r.get("hit_rate"), r.get("load_max_over_mean")  # simulated runs only
        lines.append(f"| {name} | {w['paged']} + {w['prefix']} | {r['goodput_rps']:.3f} | {r['slo_attainment']:.1%} | "
                     f"{'-' if hit is None else f'{hit:.3f}'} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{'-' if balance is None else f'{balance:.3f}'} |")
    return "\n".join(lines) + "\n"


def write_chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = list(result["stacks"])
    goodput = [result["stacks"][n]["goodput_rps"] for n in names]
    p99 = [result["stacks"][n]["ttft_p99_s"] for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) + 4), 4))
    colors = ["#d62728" if n == result["recommendation"]["best_duet"] else
              "#1f77b4" if n.startswith("duet_") else "#7f7f7f" for n in names]
    a.bar(names, goodput, color=colors)
    a.set_title("goodput (req/s within the TTFT SLO)")
    b.bar(names, p99, color=colors)
    b.set_title("TTFT p99 (s)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(f"{Path(result['trace']).name}: recommend {result['recommendation']['engine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
