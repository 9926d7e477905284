"""Per-class service figures of one simulated stack, judged by the per-class SLOs of the traffic-class table.

A request meets its SLO when its TTFT and its TPOT (mean time per output token after the first) are both
within its class's bounds (loadtests/load/class_slo.py's `FLEET_SLOS[cost_model]`: chat and document, the
table's session and document at the profile of the hardware the cost model models, gpu for h200 and h200-70b,
cpu for cpu; duet/traffic_classes.py gives the reasons; `--slo chat.ttft=2000,document.tpot=200` overrides,
ms). Goodput is requests that met their SLO
per second of offered traffic (the workload's arrival span, the same for every stack). Each class's row
carries the bound it was judged by (`slo`: ttft_ms, ttft_ms_per_prompt_token, itl_ms); the measured figures
stay in seconds.
"""

from __future__ import annotations

from loadtests.load.class_slo import FLEET_SLOS, ClassSlo, parse_class_slos
from loadtests.sim.fleet.workload import CLASSES


def parse_slos(text: str | None, cost_model: str, flag: str = "--slo") -> ClassSlo:
    """FLEET_SLOS of the cost model with `text`'s overrides (loadtests/load/class_slo.py's syntax, ms)."""
    return parse_class_slos(text, FLEET_SLOS[cost_model], CLASSES, flag)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def met(s, slos: ClassSlo) -> bool:
    return s.done and s.tokens > 0 and slos.bound(s.req.traffic_class).met_by(s.ttft_s, s.tpot_s, s.prompt_tokens)


def summarize(served: list, slos: ClassSlo, span_s: float, expected: int) -> dict:
    """The stack's figures: overall and per class (only classes present)."""
    good = [s for s in served if met(s, slos)]
    out = {"requests": expected, "completed": sum(1 for s in served if s.done),
           "slo_attainment": round(len(good) / max(1, expected), 4),
           "goodput_rps": round(len(good) / span_s, 4),
           "goodput_tokens_per_s": round(sum(s.prompt_tokens + s.tokens for s in good) / span_s, 1),
           "cached_token_share": round(sum(s.cached_tokens for s in served) / max(1, sum(s.prompt_tokens
                                                                                      for s in served)), 4),
           "classes": {}}
    for cls in CLASSES:
        mine = [s for s in served if s.req.traffic_class == cls and s.done]
        if not mine:
            continue
        ttft, tpot = [s.ttft_s for s in mine], [s.tpot_s for s in mine if s.tokens > 1]
        kinds: dict[str, int] = {}
        for s in mine:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        out["classes"][cls] = {
            "requests": len(mine), "slo": slos.bound(cls).describe(),
            "slo_attainment": round(sum(1 for s in mine if met(s, slos)) / len(mine), 4),
            "goodput_rps": round(sum(1 for s in mine if met(s, slos)) / span_s, 4),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
            "cached_token_share": round(sum(s.cached_tokens for s in mine) / max(1, sum(s.prompt_tokens
                                                                                        for s in mine)), 4),
            "served_by": kinds,
        }
    all_ttft = [s.ttft_s for s in served if s.done]
    all_tpot = [s.tpot_s for s in served if s.done and s.tokens > 1]
    out.update(ttft_p50_s=_pct(all_ttft, 0.5), ttft_p99_s=_pct(all_ttft, 0.99), tpot_p50_s=_pct(all_tpot, 0.5),
               tpot_p99_s=_pct(all_tpot, 0.99))
    return out


def add_ratios(stacks: dict[str, dict], key: str = "goodput_rps") -> None:
    """`goodput_ratio_vs_best_homogeneous` on every stack (the better of all_paged and all_prefix)."""
    best = max((stacks[k][key] for k in ("all_paged", "all_prefix") if k in stacks), default=None)
    for r in stacks.values():
        r["goodput_ratio_vs_best_homogeneous"] = (None if best is None else
                                                  round(r[key] / best, 4) if best > 0 else None)
