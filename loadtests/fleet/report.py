"""Per-class service figures of one simulated stack, and the SLOs they are judged by.

A request meets its SLO when its TTFT and its TPOT (mean time per output token after the first) are both
within its class's bounds. Goodput is requests that met their SLO per second of offered traffic (the
workload's arrival span, the same for every stack). Per-class SLOs, because a chat turn and a long document
do not share one TTFT bound (`DEFAULT_SLOS`, overridable with `--slo chat.ttft=2,document.tpot=0.2`):

    h200 (Llama-3.1-8B):  chat TTFT 3 s, TPOT 100 ms; document TTFT 6 s, TPOT 100 ms
    cpu (the bench model on one core): chat TTFT 5 s, TPOT 250 ms; document TTFT 10 s, TPOT 250 ms

(h200: Mooncake's chat turns are long (12k tokens mean, up to 126k): on an idle H200 with nothing cached,
96.6% of them get their first token within 3 s (87% within 1 s), so 3 s leaves room for queueing under a
90%-attainment goal while still failing a turn that waits behind others; 100 ms a token reads faster than a
person. A one-shot document (Azure code, at most 7.4k tokens: 0.25 s idle) may wait twice as long to start.
cpu: the local stack's bounds, duet bench compare's 5 s TTFT and 250 ms ITL, and twice that TTFT for documents.)
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.fleet.workload import CLASSES


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


DEFAULT_SLOS = {
    "h200": {"chat": Slo(3.0, 0.100), "document": Slo(6.0, 0.100)},
    "cpu": {"chat": Slo(5.0, 0.250), "document": Slo(10.0, 0.250)},
}


def parse_slos(text: str | None, cost_model: str) -> dict[str, Slo]:
    """DEFAULT_SLOS of the cost model, with `class.ttft=S` / `class.tpot=S` overrides (seconds)."""
    slos = dict(DEFAULT_SLOS[cost_model])
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        cls, _, what = key.strip().partition(".")
        if cls not in CLASSES or what not in ("ttft", "tpot"):
            raise ValueError(f"--slo: {part!r}: expected CLASS.ttft=SECONDS or CLASS.tpot=SECONDS, classes "
                             f"{', '.join(CLASSES)}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r}: {value!r} is not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"--slo: {part!r}: the bound must be > 0 seconds")
        old = slos[cls]
        slos[cls] = Slo(seconds, old.tpot_s) if what == "ttft" else Slo(old.ttft_s, seconds)
    return slos


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def met(s, slos: dict[str, Slo]) -> bool:
    slo = slos[s.req.traffic_class]
    return s.done and s.tokens > 0 and s.ttft_s <= slo.ttft_s and s.tpot_s <= slo.tpot_s


def summarize(served: list, slos: dict[str, Slo], span_s: float, expected: int) -> dict:
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
            "requests": len(mine), "slo": {"ttft_s": slos[cls].ttft_s, "tpot_s": slos[cls].tpot_s},
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
