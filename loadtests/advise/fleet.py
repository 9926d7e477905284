"""`duet bench advise --fleet`: the options in the fleet simulator (the real schedulers, router and a cost model:
loadtests/sim/fleet/), for a trace, per-class SLOs and a fleet size, judged by the one rule
(loadtests/advise/rule.py).

Options: all engine_paged and all engine_prefix, each behind the SGLang-style cache-aware router and behind
Duet's router (`paged_duet_routing`, `prefix_duet_routing`), and Duet at fixed splits P + Q (default: a quarter,
a half and three quarters of the workers paged). For each: predicted goodput, SLO attainment, TTFT/TPOT p50/p99
and the cost per million tokens served within their SLO (`worker_hour_usd` x workers / goodput tokens per hour;
default prices: $3.50 an H200-hour, $0.05 a CPU core-hour, assumptions to replace with the team's own).
Sensitivity: the same at half and at double the traffic, with the answer at each.

A gateway's capture (gateway/control/capture.py) says which engine kinds served it (`engine`); when the
recommendation differs, `canary` holds the move's first step: the routing config (the current kinds as variant
`current`, the recommended ones as `candidate` at 5%) and the canary policy whose ramp walks the candidate to 100%
under the automatic rollback (gateway/control/rollback.py), as the admin API takes them.

With step costs calibrated from external backends' measured rates (`FleetSettings.calibration`,
loadtests/advise/calibrated.py), `calibration` says whose rates at what time made the model, and `labels` names each
option by the engines it stands for ("all vllm", "2 vllm + 6 duet prefix"); the price's default follows the SLO
profile (gpu: an H200-hour, cpu: a core-hour).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from loadtests.advise.rule import BASELINES, ROUTING_ONLY, recommend
from loadtests.sim.fleet.bench import FleetSettings, run

WORKER_HOUR_USD = {"h200": 3.50, "h200-70b": 3.50, "cpu": 0.05}


CANARY_START = 5.0  # percent of the model's traffic the candidate starts with
CANARY_RAMP = ((5.0, 600.0), (25.0, 600.0), (50.0, 600.0), (100.0, 0.0))  # (weight %, hold s)


def served_by(mix: dict) -> tuple[str | None, set[str]]:
    """(model, engine kinds) a capture file in the mix was served by; (None, empty) for other traces."""
    model, kinds = None, set()
    for name in mix:
        path = Path(name)
        if not path.is_file():
            continue
        with path.open() as f:
            for line in f:
                if line.strip().startswith("{"):
                    rec = json.loads(line)
                    kinds.add(rec.get("engine") or "")
                    model = model or rec.get("model")
    kinds.discard("")
    return model, kinds


def canary_move(recommendation: dict, model: str | None, current: set[str], names: dict | None = None) -> dict | None:
    """The routing config and canary policy that start moving `model` from the `current` engine kinds to the
    recommended deployment; None when the current kinds are unknown; `needed` False when they already match.
    `names`: kind -> what serves it, in the sentences (a calibrated kind's backend engine, "vllm"); the routing
    config's pools stay kinds (an external backend's pool is its kind: gateway/backends/backend_spec.py)."""
    if not current:
        return None
    name_of = lambda k: (names or {}).get(k, k)
    split = recommendation["split"]
    wanted = {k for k in ("paged", "prefix") if split[k]}
    if wanted == current:
        return {"needed": False, "why": f"the traffic is served by {' + '.join(sorted(map(name_of, current)))} "
                                        f"already"}
    pools = lambda kinds: [{"engine_kind": k, "version": "*"} for k in sorted(kinds)]
    name = model or "MODEL"
    return {"needed": True, "model": name,
            "workers": {k: split[k] for k in ("paged", "prefix")},
            "routing": {"variants": [{"name": "current", "weight": 100.0 - CANARY_START, "pools": pools(current)},
                                     {"name": "candidate", "weight": CANARY_START, "pools": pools(wanted)}]},
            "canary_policy": {"canary": "candidate", "baseline": "current",
                              "ramp": [{"weight": w, "hold_s": h} for w, h in CANARY_RAMP]},
            "steps": [(f"start {' and '.join(sorted(map(name_of, wanted - current)))} workers" if wanted - current
                       else f"no new kind: the candidate is the {' and '.join(sorted(map(name_of, wanted)))} workers "
                            f"already serving")
                      + f" (the recommendation: {split['paged']} paged + {split['prefix']} prefix)",
                      f"PUT /admin/models/{name}/routing with `routing`",
                      (f"PUT /admin/models/{name}/canary-policy with `canary_policy`: the rollback controller "
                       f"ramps the candidate to 100% or rolls it back"),
                      (f"once at 100%: retire the {' and '.join(sorted(map(name_of, current - wanted))) or 'old'} "
                       f"workers")]}


def calibrated_price(cal) -> float:
    from loadtests.advise.calibrated import WORKER_HOUR_USD as BY_PROFILE

    return BY_PROFILE[cal.slo_profile]


def option_labels(options: dict, cal) -> dict:
    """Each option named by the engines it stands for: a measured kind by its backend's engine (vllm, sglang), the
    other by Duet's engine (priced at the measured costs: the calibration's notes)."""
    def engine(kind: str) -> str:
        r = cal.rates.get(kind)
        return r.engine if r is not None and r.engine != "duet" else f"duet {kind}"

    out = {}
    for name, o in options.items():
        w = o["workers"]
        parts = [f"{w[k]} {engine(k)}" for k in ("paged", "prefix") if w[k]]
        label = f"all {engine('paged' if w['paged'] else 'prefix')}" if len(parts) == 1 else " + ".join(parts)
        if name.endswith("_duet_routing"):
            label += ", Duet's routing"
        out[name] = label
    return out


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


def options_settings(s: FleetSettings) -> FleetSettings:
    """The settings whose stacks are advise's options: both baselines, the routing-only ones and the splits."""
    return replace(s, stacks=BASELINES + ROUTING_ONLY, splits=s.splits or default_splits(s.workers)).validate()


def advise(s: FleetSettings, worker_hour_usd: float | None = None, progress=None) -> dict:
    if s.workers < 2:
        raise ValueError(f"--workers must be >= 2 (a split needs one worker of each kind), got {s.workers}")
    s = options_settings(s)
    cal = s.calibration
    default_price = calibrated_price(cal) if cal is not None else WORKER_HOUR_USD[s.cost_model]
    price = default_price if worker_hour_usd is None else worker_hour_usd
    if price <= 0:
        raise ValueError(f"--worker-hour-usd must be > 0, got {price}")
    out = {"mode": "fleet simulator", "mix": s.mix, "workers": s.workers, "cost_model": s.cost_model, "worker_hour_usd": price,
           "window_s": s.window_s, "chain_sessions": s.chain_sessions, "rates": {}}
    if cal is not None:
        out["calibration"] = cal.describe()
        if worker_hour_usd is None:
            out["calibration"]["notes"].append(
                f"cost per million tokens at ${price:g} a worker-hour, the {cal.slo_profile} profile's default "
                f"({'an H200-hour' if cal.slo_profile == 'gpu' else 'a CPU core-hour'}): --worker-hour-usd sets yours")
    for label, factor in (("traffic", 1.0), ("half_traffic", 0.5), ("double_traffic", 2.0)):
        result = run(replace(s, rate=s.rate * factor), progress=progress)
        options = {name: _option(r, s, price) for name, r in result["stacks"].items()}
        out["rates"][label] = {"rate": s.rate * factor, "options": options, "recommendation": recommend(options)}
    out["recommendation"] = out["rates"]["traffic"]["recommendation"]
    out["sensitivity"] = {label: r["recommendation"]["deployment"] for label, r in out["rates"].items()}
    if cal is not None:
        out["labels"] = option_labels(out["rates"]["traffic"]["options"], cal)
    model, current = served_by(s.mix)
    if current:
        out["served_by"] = sorted(current)
        names = None
        if cal is not None:  # a calibrated kind by its backend's engine, the other as Duet's engine
            names = {k: r.engine for k, r in cal.rates.items() if r.engine != "duet"}
            names.update({k: f"duet {k}" for k in ("paged", "prefix") if k not in names})
        out["canary"] = canary_move(out["recommendation"], model, current, names)
    return out
