"""The one rule `duet bench advise` recommends by, in every mode (the routing simulation, a local replay, the
fleet simulator): it reads only the options' figures, never how they were measured.

The options, by name (a mode measures some of them; each has `goodput_rps`, `ttft_p99_s` and `workers`):

    all_paged, all_prefix                    one engine kind behind the SGLang-style cache-aware router: the
                                             deployments teams run today (the baselines)
    paged_duet_routing, prefix_duet_routing  one engine kind behind Duet's router: what the router alone is worth
    duet_*                                   a split of both kinds behind Duet's router

An option clearly beats another when its goodput is more than `MARGIN` above the other's (some goodput against
none counts; none against none is a tie) and its TTFT p99 is no worse. The rule keeps apart what the router and
what the pairing of two engine kinds are worth (the fleet simulations found Duet's gain to be mostly its
routing's: docs/benchmarks.md):

1. the best split, when it clearly beats the best one-kind option behind either router: pairing pays;
2. else the best one-kind option behind Duet's router, when it clearly beats the best baseline: the gain is
   the routing's, and one engine kind is enough;
3. else the best baseline: one kind behind a cache-aware router is as good, and simpler to run.

"Best" is by goodput, then TTFT p99. Between the two baselines a tie goes to the trace's reuse when the mode
measured it: prefix when more than `PREFIX_REUSE` of the prompt tokens repeat an earlier prompt's prefix
(radix caching and cache-aware scheduling pay), paged otherwise.
"""

from __future__ import annotations

MARGIN = 0.05  # a gain this small is not worth a second engine kind, or a second router
PREFIX_REUSE = 0.10  # token share repeating an earlier prefix above which prefix caching is the better bet
BASELINES = ("all_paged", "all_prefix")
ROUTING_ONLY = ("paged_duet_routing", "prefix_duet_routing")
SPLIT_PREFIX = "duet_"


def _p99(option: dict) -> float:
    p99 = option.get("ttft_p99_s")
    return float("inf") if p99 is None else p99  # nothing completed: the worst tail


def _key(option: dict) -> tuple[float, float]:
    return option["goodput_rps"], -_p99(option)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (float("inf") if a > 0 else 1.0)


def clearly_beats(a: dict, b: dict) -> bool:
    return _ratio(a["goodput_rps"], b["goodput_rps"]) > 1 + MARGIN and _p99(a) <= _p99(b)


def _best(options: dict, names, prefer: str | None = None) -> str:
    return max((k for k in names if k in options), key=lambda k: (_key(options[k]), k == prefer))


def recommend(options: dict, reuse: float | None = None) -> dict:
    """The recommendation, the options it was chosen among and the figures it rests on (module docstring).
    `options` holds both baselines and at least one split; `reuse`: the trace's reuse share, when measured."""
    prefer = None if reuse is None else ("all_prefix" if reuse > PREFIX_REUSE else "all_paged")
    baseline = _best(options, BASELINES, prefer)
    one_kind = _best(options, (baseline, *ROUTING_ONLY))
    split = _best(options, [k for k in options if k.startswith(SPLIT_PREFIX)])
    pairing = _ratio(options[split]["goodput_rps"], options[one_kind]["goodput_rps"])
    routing = _ratio(options[one_kind]["goodput_rps"], options[baseline]["goodput_rps"])
    reuse_note = "" if reuse is None else f"; {reuse:.0%} of the trace's prompt blocks repeat an earlier prefix"

    if clearly_beats(options[split], options[one_kind]):
        chosen = split
        why = (f"{split} serves {pairing:.2f}x the goodput of the best one-kind option ({one_kind}) at TTFT p99 "
               f"{_p99(options[split]):.2f} s against {_p99(options[one_kind]):.2f} s: pairing the two engine kinds pays")
    elif one_kind in ROUTING_ONLY and clearly_beats(options[one_kind], options[baseline]):
        chosen = one_kind
        why = (f"engine_{one_kind.split('_')[0]} alone behind Duet's router serves {routing:.2f}x {baseline} behind the "
               f"SGLang-style router, and the best split ({split}) adds {pairing:.2f}x, within {MARGIN:.0%} or with a "
               f"worse TTFT p99: the gain is the routing's, one engine kind is enough")
    else:
        chosen = baseline
        why = (f"the best split ({split}) reaches {pairing:.2f}x the best one-kind option ({one_kind}), within "
               f"{MARGIN:.0%} or with a worse TTFT p99, and Duet's router alone {routing:.2f}x: one engine kind "
               f"behind a cache-aware router is as good and simpler to run{reuse_note}")
    w = options[chosen]["workers"]
    engine = "both" if w["paged"] and w["prefix"] else ("paged" if w["paged"] else "prefix")
    out = {"deployment": chosen, "engine": engine,
           "router": "sglang-style" if chosen in BASELINES else "duet",
           "split": {"paged": w["paged"], "prefix": w["prefix"]},
           "best_split": split, "best_one_kind": one_kind, "best_homogeneous": baseline,
           "goodput_ratio_vs_best_homogeneous": round(_ratio(options[split]["goodput_rps"],
                                                             options[baseline]["goodput_rps"]), 3),
           "split_ratio_vs_best_one_kind": round(pairing, 3), "why": why}
    if reuse is not None:
        out["reuse_share"] = round(reuse, 4)
    return out
