"""`duet bench advise --fleet`: which deployment to run, answered by the fleet simulator (the real schedulers,
router and cost model: loadtests/sim/fleet/), for a trace, per-class SLOs and a fleet size.

Options: all engine_paged and all engine_prefix, each behind the SGLang-style cache-aware router and behind
Duet's router (`paged_duet_routing`, `prefix_duet_routing`), and Duet at fixed splits P + Q (default: a quarter,
a half and three quarters of the workers paged). For each: predicted goodput, SLO attainment, TTFT/TPOT p50/p99
and the cost per million tokens served within their SLO (`worker_hour_usd` x workers / goodput tokens per hour;
default prices: $3.50 an H200-hour, $0.05 a CPU core-hour, assumptions to replace with the team's own).

The recommendation keeps apart what the router and what the pairing are worth (the fleet simulations found
Duet's gain to be its routing's: docs/benchmarks.md): a split only when it beats the best one-kind fleet behind
EITHER router by more than `advise.MARGIN`; else one kind behind Duet's router when that beats the best fleet
behind the SGLang-style router by more than the margin; else the better homogeneous fleet. Sensitivity: the
same at half and at double the traffic, with the answer at each.
"""

from __future__ import annotations

from dataclasses import replace

from loadtests.advise.routing_sim import MARGIN
from loadtests.sim.fleet.bench import ROUTING_ONLY, FleetSettings, run

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


def _best(options: dict, names) -> str:
    return max((k for k in names if k in options),
               key=lambda k: (options[k]["goodput_rps"], -options[k]["ttft_p99_s"]))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (float("inf") if a > 0 else 1.0)


def recommend(options: dict) -> dict:
    best_homo = _best(options, ("all_paged", "all_prefix"))  # behind the SGLang-style router
    one_kind = _best(options, ("all_paged", "all_prefix") + ROUTING_ONLY)  # behind either router
    best_duet = _best(options, [k for k in options if k.startswith("duet_")])
    goodput = {k: options[k]["goodput_rps"] for k in (best_homo, one_kind, best_duet)}
    pairing = _ratio(goodput[best_duet], goodput[one_kind])

    def pick(name: str, why: str) -> dict:
        w = options[name]["workers"]
        return {"deployment": name, "paged": w["paged"], "prefix": w["prefix"],
                "router": "sglang-style" if name in ("all_paged", "all_prefix") else "duet",
                "goodput_ratio_vs_best_homogeneous": round(_ratio(goodput[best_duet], goodput[best_homo]), 3),
                "split_ratio_vs_best_one_kind": round(pairing, 3), "why": why}

    if pairing > 1 + MARGIN:
        return pick(best_duet, f"{best_duet} serves {pairing:.2f}x the goodput of the best one-kind fleet "
                               f"({one_kind}) within the SLOs: pairing the two engine kinds pays")
    routing = _ratio(goodput[one_kind], goodput[best_homo])
    if one_kind in ROUTING_ONLY and routing > 1 + MARGIN:
        kind = one_kind.split("_")[0]
        return pick(one_kind, f"all engine_{kind} behind Duet's router serves {routing:.2f}x {best_homo} behind "
                              f"the SGLang-style router, and the best split ({best_duet}) adds {pairing:.2f}x, "
                              f"within {MARGIN:.0%}: the gain is the routing's, one engine kind is enough")
    return pick(best_homo, f"the best Duet split ({best_duet}) reaches {pairing:.2f}x the best one-kind fleet "
                           f"({one_kind}), within {MARGIN:.0%}: one engine kind is as good and simpler to run")


def advise(s: FleetSettings, worker_hour_usd: float | None = None, progress=None) -> dict:
    if s.workers < 2:
        raise ValueError(f"--workers must be >= 2 (a split needs one worker of each kind), got {s.workers}")
    s = replace(s, stacks=("all_paged", "all_prefix") + ROUTING_ONLY,
                splits=s.splits or default_splits(s.workers)).validate()
    price = WORKER_HOUR_USD[s.cost_model] if worker_hour_usd is None else worker_hour_usd
    if price <= 0:
        raise ValueError(f"--worker-hour-usd must be > 0, got {price}")
    out = {"mix": s.mix, "workers": s.workers, "cost_model": s.cost_model, "worker_hour_usd": price,
           "window_s": s.window_s, "rates": {}}
    for label, factor in (("traffic", 1.0), ("half_traffic", 0.5), ("double_traffic", 2.0)):
        result = run(replace(s, rate=s.rate * factor), progress=progress)
        options = {name: _option(r, s, price) for name, r in result["stacks"].items()}
        out["rates"][label] = {"rate": s.rate * factor, "options": options, "recommendation": recommend(options)}
    out["recommendation"] = out["rates"]["traffic"]["recommendation"]
    out["sensitivity"] = {label: r["recommendation"]["deployment"] for label, r in out["rates"].items()}
    return out


def format_markdown(result: dict) -> str:
    rec = result["recommendation"]
    lines = [f"# duet bench advise --fleet: {result['workers']} workers, cost model {result['cost_model']}", "",
             (f"**Run {rec['deployment']}** ({rec['paged']} paged + {rec['prefix']} prefix, {rec['router']} router): "
              f"{rec['why']}."), "",
             "Sensitivity: " + ", ".join(f"{k.replace('_', ' ')} -> {v}" for k, v in result["sensitivity"].items()),
             "", ("| traffic | option | paged + prefix | goodput req/s | SLO met | TTFT p50 / p99 s | TPOT p50 / p99 ms | "
             "$ per M tokens |"), "|---|---|---|---|---|---|---|---|"]
    for label, r in result["rates"].items():
        for name, o in r["options"].items():
            w = o["workers"]
            lines.append(f"| {label} (x{r['rate']:g}) | {name} | {w['paged']} + {w['prefix']} | {o['goodput_rps']} | "
                         f"{o['slo_attainment']:.1%} | {o['ttft_p50_s']} / {o['ttft_p99_s']} | "
                         f"{1000 * (o['tpot_p50_s'] or 0):.1f} / {1000 * (o['tpot_p99_s'] or 0):.1f} | "
                         f"{o['usd_per_million_tokens']} |")
    return "\n".join(lines) + "\n"
