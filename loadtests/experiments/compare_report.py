"""What `duet bench compare` prints: per rate, each stack's goodput and long-document TTFT p99 with the two
headline ratios (median, min and max over the repeats), whether the targets are met, and the markdown table.

Kept apart from compare.py, which runs the stacks: these functions only read the result dictionaries."""

from __future__ import annotations

import statistics

HOMOGENEOUS = ("all_paged", "all_prefix")


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _doc_p99(r: dict | None) -> float | None:
    return r["classes"].get("long_doc", {}).get("ttft_p99_ms") if r else None


def _spread(values: list) -> dict:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def rate_summary(runs: dict[str, list[dict]]) -> dict:
    """Per stack: goodput and long-document TTFT p99 and the two headline ratios, each as median / min
    / max over the repeats (repeat i of a stack is compared with repeat i of the baselines)."""
    reps = min(len(v) for v in runs.values())
    out = {}
    for name, rs in runs.items():
        ratios, docs = [], []
        for i in range(reps):
            homogeneous = [runs[h][i]["goodput_rps"] for h in HOMOGENEOUS if h in runs]
            ratios.append(_ratio(rs[i]["goodput_rps"], max(homogeneous)) if homogeneous else None)
            docs.append(_ratio(_doc_p99(rs[i]), _doc_p99(runs["all_paged"][i])) if "all_paged" in runs else None)
        out[name] = {"goodput_rps": _spread([r["goodput_rps"] for r in rs]),
                     "long_doc_ttft_p99_ms": _spread([_doc_p99(r) for r in rs]),
                     "goodput_ratio_vs_best_homogeneous": _spread(ratios),
                     "long_doc_ttft_p99_ratio_vs_paged": _spread(docs)}
    return out


def headline(rates: dict) -> dict:
    """The target figures: duet_planner's (else duet_fixed's) median ratios at each rate, and whether
    they meet the issue's bounds (goodput >= 1.2 at medium and heavy, >= 1.0 at light; long-document
    TTFT p99 <= 1.0 everywhere)."""
    goodput, doc = {}, {}
    for rate, r in rates.items():
        stack = next((c for c in ("duet_planner", "duet_fixed") if c in r["summary"]), None)
        if stack is None:
            continue
        goodput[rate] = r["summary"][stack]["goodput_ratio_vs_best_homogeneous"]["median"]
        doc[rate] = r["summary"][stack]["long_doc_ttft_p99_ratio_vs_paged"]["median"]
    met = None
    if goodput and all(v is not None for v in (*goodput.values(), *doc.values())):
        met = all(v >= (1.0 if k == "light" else 1.2) for k, v in goodput.items()) and all(v <= 1.0 for v in doc.values())
    return {"goodput_ratio_vs_best_homogeneous": goodput, "long_doc_ttft_p99_ratio_vs_paged": doc, "target_met": met}


def _f(x, digits=0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _m(spread: dict, digits: int) -> str:
    if spread["median"] is None:
        return "-"
    if spread["n"] > 1:
        return f"{spread['median']:.{digits}f} [{spread['min']:.{digits}f}-{spread['max']:.{digits}f}]"
    return f"{spread['median']:.{digits}f}"


def format_table(result: dict) -> str:
    slo = result["slo"]
    bound = (f"TTFT <= {slo['ttft_ms']:.0f} ms and TPOT <= {slo['itl_ms']:.0f} ms" if "per_class" not in slo else
             "per class: " + ", ".join(f"{c} TTFT <= {b['ttft_ms']:.0f} ms" +
                                       (f" + {b['ttft_ms_per_prompt_token']:g} ms/token" if b["ttft_ms_per_prompt_token"]
                                        else "") for c, b in slo["per_class"].items()))
    pins = f", one worker per core ({', '.join(result['pinned_cores'])})" if result.get("pinned_cores") else ""
    lines = [(f"duet bench compare on {result['model']} (cpu), KV {result['kv_cache_tokens_per_worker']} tokens/worker, "
              f"paged prefix caching {'on' if result['paged_prefix_caching'] else 'off (engine lacks it)'}{pins}, "
              f"SLO: {bound}; median [min-max] over repeats"), ""]
    head = ["rate", "stack", "goodput req/s", "long_doc TTFT p99 ms", "goodput / best homogeneous",
            "long_doc p99 / all_paged"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate_name, r in result["rates"].items():
        for name, m in r["summary"].items():
            lines.append(f"| {rate_name} ({r['rate']}/s, {r['num_requests']} req) | {name} | {_m(m['goodput_rps'], 3)} | "
                         f"{_m(m['long_doc_ttft_p99_ms'], 0)} | {_m(m['goodput_ratio_vs_best_homogeneous'], 3)} | "
                         f"{_m(m['long_doc_ttft_p99_ratio_vs_paged'], 3)} |")
    lines.append("")
    for rate_name, r in result["rates"].items():
        for name, runs in r["runs"].items():
            for i, run in enumerate(runs):
                errs = f", errors: {run['errors']}" if run["errors"] else ""
                sw = f", {len(run['switches'])} switches -> {run['workers_after']}" if "switches" in run else ""
                lines.append(f"{rate_name} #{i + 1} {name}: {run['num_good']}/{run['num_requests']} good, "
                             f"engines {run['engines']}{sw}{errs}")
    lines += ["", (f"goodput_ratio_vs_best_homogeneous (median): {result['goodput_ratio_vs_best_homogeneous']} "
                   "(target >= 1.2 medium/heavy, >= 1.0 light)"),
              f"long_doc_ttft_p99_ratio_vs_paged (median): {result['long_doc_ttft_p99_ratio_vs_paged']} (target <= 1.0)"]
    return "\n".join(lines)
