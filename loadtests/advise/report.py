"""What `duet bench advise` prints and writes, in every mode: the markdown (the recommendation first, then each
option's figures), and with `--out DIR` advice.md, advice.json and advice.png (goodput and TTFT p99 per option,
the chosen one in red). These functions only read the result dictionaries the modes return."""

from __future__ import annotations

import json
from pathlib import Path

FLEET = "fleet simulator"  # the fleet mode's result["mode"]: its options are per traffic level


def options_of(result: dict) -> dict:
    """The options the recommendation was made among (the fleet mode: at the given traffic)."""
    return result["rates"]["traffic"]["options"] if result["mode"] == FLEET else result["stacks"]


def _recommendation(rec: dict) -> str:
    s = rec["split"]
    return (f"**Recommendation: {rec['deployment']}** ({s['paged']} paged + {s['prefix']} prefix, {rec['router']} "
            f"router). {rec['why']}.")


def _trace_markdown(result: dict) -> list[str]:
    st = result["settings"]
    lines = [f"# duet bench advise: {Path(result['trace']).name}", "",
             f"{result['records']} requests ({result['format']}), {result['mode']}, {st['workers']} workers"
             + (f" x {st['cache_blocks']} blocks" if "cache_blocks" in st else "")
             + f", TTFT SLO {st['slo_ttft_s']} s", "", _recommendation(result["recommendation"]), "",
             "| option | paged + prefix | goodput req/s | SLO met | hit rate | TTFT p50 s | TTFT p99 s | load max/mean |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result["stacks"].items():
        w = r["workers"]
        hit, balance = r.get("hit_rate"), r.get("load_max_over_mean")  # simulated runs only
        lines.append(f"| {name} | {w['paged']} + {w['prefix']} | {r['goodput_rps']:.3f} | {r['slo_attainment']:.1%} | "
                     f"{'-' if hit is None else f'{hit:.3f}'} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{'-' if balance is None else f'{balance:.3f}'} |")
    return lines


def _fleet_markdown(result: dict) -> list[str]:
    mix = ", ".join(f"{k} x{v:g}" for k, v in result["mix"].items())
    lines = [f"# duet bench advise --fleet: {result['workers']} workers, cost model {result['cost_model']}", "",
             f"{mix}, {result['window_s']:g} trace seconds, {result['mode']}"
             + ("" if result.get("chain_sessions", True) else ", every request at its own arrival time (an open-loop "
                "client, as --validate's replay sends them; a session's turns are not held for the previous answer)"),
             ""]
    labels = result.get("labels", {})
    if "cost_fit" in result:
        from loadtests.sim.fleet.cpu_fit import format_fit

        lines += format_fit(result["cost_fit"])
    if "calibration" in result:
        cal = result["calibration"]
        lines += ["Step costs:"] + [f"- {kind} ({c['scheduler']}): {c['source']}" for kind, c in cal["kinds"].items()]
        lines += [f"- {note}" for note in cal["notes"]]
        lines += [f"- SLOs: duet/traffic_classes.py at the {cal['slo_profile']} profile ({cal['slo_source']})", ""]
    rec = result["recommendation"]
    lines += [
             _recommendation(rec) + (f" That is {labels[rec['deployment']]}." if rec["deployment"] in labels else ""),
             "",
             "Sensitivity: " + ", ".join(f"{k.replace('_', ' ')} -> {v}" for k, v in result["sensitivity"].items()),
             "", ("| traffic | option | paged + prefix | goodput req/s | SLO met | TTFT p50 / p99 s | TPOT p50 / p99 ms | "
                  "$ per M tokens |"), "|---|---|---|---|---|---|---|---|"]
    for label, r in result["rates"].items():
        for name, o in r["options"].items():
            w = o["workers"]
            shown = f"{name} ({labels[name]})" if name in labels else name
            lines.append(f"| {label} (x{r['rate']:g}) | {shown} | {w['paged']} + {w['prefix']} | {o['goodput_rps']} | "
                         f"{o['slo_attainment']:.1%} | {o['ttft_p50_s']} / {o['ttft_p99_s']} | "
                         f"{1000 * (o['tpot_p50_s'] or 0):.1f} / {1000 * (o['tpot_p99_s'] or 0):.1f} | "
                         f"{o['usd_per_million_tokens']} |")
    canary = result.get("canary")
    if canary and canary["needed"]:
        lines += ["", f"**The move** (now served by {' + '.join(result['served_by'])}):", ""]
        lines += [f"{i}. {step}" for i, step in enumerate(canary["steps"], 1)]
        lines += ["", "```json", json.dumps({"routing": canary["routing"], "canary_policy": canary["canary_policy"]},
                                            indent=2), "```"]
    elif canary:
        lines += ["", f"No move: {canary['why']}."]
    if "validation" in result:
        from loadtests.advise.validate import format_validation

        lines += format_validation(result["validation"]).splitlines()
    return lines


def format_markdown(result: dict) -> str:
    lines = _fleet_markdown(result) if result["mode"] == FLEET else _trace_markdown(result)
    return "\n".join(lines) + "\n"


def write_chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    options = options_of(result)
    rec = result["recommendation"]
    names = list(options)
    goodput = [options[n]["goodput_rps"] for n in names]
    p99 = [options[n]["ttft_p99_s"] or 0.0 for n in names]
    colors = ["#d62728" if n == rec["deployment"] else "#1f77b4" if n.startswith("duet") else "#7f7f7f"
              for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) + 4), 4))
    a.bar(names, goodput, color=colors)
    a.set_title("goodput (req/s within the SLO)")
    b.bar(names, p99, color=colors)
    b.set_title("TTFT p99 (s)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45)
    source = Path(result["trace"]).name if "trace" in result else f"{result['workers']} workers, {result['cost_model']}"
    fig.suptitle(f"{source}: recommend {rec['deployment']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_out(result: dict, text: str, out: Path) -> None:
    """advice.md (`text`), advice.json and advice.png in `out` (made when missing)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "advice.md").write_text(text)
    (out / "advice.json").write_text(json.dumps(result, indent=2))
    write_chart(result, out / "advice.png")
