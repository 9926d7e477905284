"""`duet bench advise --fleet`: the options in the fleet simulator (the real schedulers, router and a cost model:
loadtests/sim/fleet/), for a trace, per-class SLOs and a fleet size, judged by the one rule
(loadtests/advise/rule.py).

Options: all engine_paged and all engine_prefix, each behind the SGLang-style cache-aware router and behind
Duet's router (`paged_duet_routing`, `prefix_duet_routing`), and Duet at fixed splits P + Q (default: a quarter,
a half and three quarters of the workers paged). For each: predicted goodput, SLO attainment, TTFT/TPOT p50/p99
and the cost per million tokens served within their SLO (`worker_hour_usd` x workers / goodput tokens per hour;
default prices: $3.50 an H200-hour, $0.05 a CPU core-hour, assumptions to replace with the team's own).
Sensitivity: the same at half and at double the traffic, with the answer at each.
"""

from __future__ import annotations

from dataclasses import replace

from loadtests.advise.rule import BASELINES, ROUTING_ONLY, recommend
from loadtests.sim.fleet.bench import FleetSettings, run

WORKER_HOUR_USD = {"h200": 3.50, "h200-70b": 3.50, "cpu": 0.05}


def default_splits(n: int) -> tuple[tuple[int, int], ...]:
    paged = sorted({max(1, min(n - 1, round(n * f))) for f in (0.25, 0.5, 0.75)})
    return tuple((p, n - p) for p in paged)


def _option(r: dict, s: FleetSettings, price: float) -> dict:
    per_hour = r["goodput_tokens_per_s"] * 3600
    return {"workers": r["workers"]["start"], "goodput_rps": r["goodput_rps"], "slo_attainment": r["slo_attainment"],
            "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"], "tpot_p50_s": r["tpot_p50_s"],
            "tpot_p99_s": r["tpot_p99_s"],
            "usd_per_million_tokens": round(s.workers * price / per_hour * 1e6, 4) if per_hour > 0 else None,
            "classes": {c: {k: v[k] for k in ("slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                                "tpot_p99_s")} for c, v in r["classes"].items()}}


def advise(s: FleetSettings, worker_hour_usd: float | None = None, progress=None) -> dict:
    if s.workers < 2:
        raise ValueError(f"--workers must be >= 2 (a split needs one worker of each kind), got {s.workers}")
    s = replace(s, stacks=BASELINES + ROUTING_ONLY,
                splits=s.splits or default_splits(s.workers)).validate()
    price = WORKER_HOUR_USD[s.cost_model] if worker_hour_usd is None else worker_hour_usd
    if price <= 0:
        raise ValueError(f"--worker-hour-usd must be > 0, got {price}")
    out = {"mode": "fleet simulator", "mix": s.mix, "workers": s.workers, "cost_model": s.cost_model, "worker_hour_usd": price,
           "window_s": s.window_s, "rates": {}}
    for label, factor in (("traffic", 1.0), ("half_traffic", 0.5), ("double_traffic", 2.0)):
        result = run(replace(s, rate=s.rate * factor), progress=progress)
        options = {name: _option(r, s, price) for name, r in result["stacks"].items()}
        out["rates"][label] = {"rate": s.rate * factor, "options": options, "recommendation": recommend(options)}
    out["recommendation"] = out["rates"]["traffic"]["recommendation"]
    out["sensitivity"] = {label: r["recommendation"]["deployment"] for label, r in out["rates"].items()}
    return out
