"""The flags of `duet bench fleet` (loadtests/cli.py adds them); argparse only, the runs import lazily.
`--validate` hands over to loadtests/sim/fleet/validate.py."""

from __future__ import annotations

import argparse
import json
import sys

from loadtests.sim.fleet.cost_models import COST_MODELS

WINDOW_S, RATE = 300.0, 1.0  # the simulator runs' --window-s and --rate when not given


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fleet", help="fleet simulator: the real schedulers and router over N workers on a virtual clock",
        description="Runs all-paged, all-prefix and Duet (with the pool planner, and any --split) over N simulated "
        "workers: each the real scheduler of its kind driven by the real EngineCore, its model replaced by a cost "
        "model on a virtual clock, behind the real gateway routing, prefix tables and pool planner "
        "(loadtests/sim/fleet/). Deterministic; prints goodput and TTFT/TPOT per traffic class.")
    p.add_argument("--cost-model", default="h200",
                   help="h200 (a roofline of Llama-3.1-8B on one H200), h200-70b (Llama-3.1-70B FP8 on one H200: a "
                   "fifth of the KV per worker) or cpu (fitted on this machine: duet bench fleet-calibrate)")
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--trace", default="mixed", help="mixed (Mooncake chat + Azure code documents), chat, documents, "
                   "source=multiplier,... (mooncake, azure_code, azure_conv) or a trace file")
    p.add_argument("--window-s", type=float, default=None, help=f"trace seconds taken from each source "
                   f"(default {WINDOW_S}; --validate: its own)")
    p.add_argument("--rate", type=float, default=None, help=f"arrival-rate multiplier (2: twice the trace's rate; "
                   f"default {RATE}; --validate: its own)")
    p.add_argument("--find-rate", action="store_true", help="first find the rate at which the best homogeneous "
                   "stack meets --attainment of its SLOs, and each stack's capacity (many runs)")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--rate-range", default="1:16", help="--find-rate: LOW:HIGH multipliers to search")
    p.add_argument("--search-steps", type=int, default=5, help="--find-rate: bisection steps per stack")
    p.add_argument("--stacks", default="all_paged,all_prefix,duet_planner", help="all_paged, all_prefix, "
                   "duet_planner, paged_duet_routing, prefix_duet_routing, and the peers' policies smg_cache_aware, "
                   "vllm_kv_aware, llmd_default (N engine_prefix workers behind each)")
    p.add_argument("--contest", action="store_true", help="each peer in --stacks against Duet's routing over the "
                   "same workers (prefix_duet_routing), at the rate where the peer meets --attainment of its SLOs")
    p.add_argument("--split", action="append", default=[], help="a fixed Duet split PAGED:PREFIX (repeatable)")
    p.add_argument("--slo", default=None, help="per-class bounds in ms, e.g. chat.ttft=3000,document.ttft=6s,"
                   "chat.tpot=100 (defaults: duet/traffic_classes.py at the cost model's profile)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output")
    p.add_argument("--switch-s", type=float, default=None, help="planner: seconds a worker is away switching kind")
    p.add_argument("--planner-window-s", type=float, default=None, help="planner: rate window and cooldown "
                   "(default: the gateway's 30 s; a run of tens of virtual seconds needs a shorter one to act)")
    p.add_argument("--validate", action="store_true", help="run the workload on the local pinned stack and in the "
                   "simulator (cpu model) and print the relative errors (loadtests/sim/fleet/validate.py); it reads "
                   "--window-s and --rate when given (default: 60 s at 0.5)")
    p.add_argument("--per-request", default=None, metavar="PATH", help="--validate: write both sides of every "
                   "request (engine, route reason, cached tokens, TTFT, TPOT) to PATH as JSON lines")
    p.add_argument("--cost-file", default=None, metavar="FILE", help="cpu cost model and --validate: the fit to "
                   "read (default: this machine's own from duet bench fleet-calibrate, else the repository's "
                   "loadtests/sim/fleet/cpu_cost.json: loadtests/sim/fleet/cpu_fit.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_run_fleet)


def settings_from(args: argparse.Namespace):
    from loadtests.sim.fleet.bench import FleetSettings, parse_split
    from loadtests.sim.fleet.report import parse_slos
    from loadtests.sim.fleet.workload import parse_mix

    if args.cost_model not in COST_MODELS:
        raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, got {args.cost_model!r}")
    return FleetSettings(cost_model=args.cost_model, workers=args.workers, mix=parse_mix(args.trace),
                         window_s=WINDOW_S if args.window_s is None else args.window_s,
                         rate=RATE if args.rate is None else args.rate,
                         stacks=tuple(x.strip() for x in args.stacks.split(",") if x.strip()),
                         splits=tuple(parse_split(x) for x in args.split), slos=parse_slos(args.slo, args.cost_model),
                         max_output_tokens=args.max_output_tokens, switch_s=args.switch_s,
                         planner_window_s=args.planner_window_s,
                         attainment=args.attainment, rate_range=_rate_range(args.rate_range),
                         search_steps=args.search_steps).validate()


def validate_settings(args: argparse.Namespace):
    """--validate's workload: its own defaults, or --window-s / --rate when given on the command line."""
    from loadtests.sim.fleet.validate import ValidateSettings

    base = ValidateSettings()
    window = base.window_s if args.window_s is None else args.window_s
    rate = base.rate if args.rate is None else args.rate
    if window <= 0 or rate <= 0:
        raise ValueError(f"--window-s and --rate must be > 0, got {window} and {rate}")
    return ValidateSettings(window_s=window, rate=rate)


def _rate_range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep or not 0 < float(lo) < float(hi):
            raise ValueError
        return float(lo), float(hi)
    except ValueError:
        raise ValueError(f"--rate-range {text!r}: expected LOW:HIGH with 0 < LOW < HIGH, e.g. 1:16") from None


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_fleet(args: argparse.Namespace) -> int:
    from loadtests.sim.fleet.cpu_fit import use_cost_file

    cost_file = getattr(args, "cost_file", None)
    if cost_file is not None and not (args.validate or args.cost_model == "cpu"):
        raise ValueError(f"--cost-file is the cpu cost model's fit: give it with --cost-model cpu or --validate, "
                         f"not --cost-model {args.cost_model}")
    use_cost_file(cost_file)
    if args.validate:
        from loadtests.sim.fleet.validate import format_table as validate_table
        from loadtests.sim.fleet.validate import validate

        result = validate(validate_settings(args), progress=_progress, per_request=args.per_request)
        print(json.dumps(result, indent=2) if args.json else validate_table(result))
        return 0
    if args.contest:
        from loadtests.sim.fleet.bench import contest

        result = contest(settings_from(args), progress=_progress)
        print(json.dumps(result, indent=2) if args.json else format_contest(result))
        return 0
    from loadtests.sim.fleet.bench import run

    result = run(settings_from(args), find_rate=args.find_rate, progress=_progress)
    if args.cost_model == "cpu":
        from loadtests.sim.fleet.cpu_fit import fit_report

        result["cost_fit"] = fit_report()  # which machine the figures describe
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def format_table(result: dict) -> str:
    from loadtests.sim.fleet.cpu_fit import format_warning

    lines = [*format_warning(result.get("cost_fit")), (f"fleet: {result['workers']} workers, cost model {result['cost_model']}, mix {result['mix']}, "
             f"window {result['window_s']} s, rate x{result['rate']}"), "",
             ("| stack | workers end (paged+prefix) | goodput req/s | SLO met | vs best homogeneous | class | "
             "TTFT p50 / p99 s | TPOT p50 / p99 ms | cached |"), "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["stacks"].items():
        end = r["workers"]["end"]
        for cls, c in r["classes"].items():
            lines.append(f"| {name} | {end['paged']} + {end['prefix']} | {r['goodput_rps']} | {r['slo_attainment']:.1%} | "
                         f"{r['goodput_ratio_vs_best_homogeneous']} | {cls} ({c['slo_attainment']:.1%}) | "
                         f"{c['ttft_p50_s']} / {c['ttft_p99_s']} | {1000 * (c['tpot_p50_s'] or 0):.1f} / "
                         f"{1000 * (c['tpot_p99_s'] or 0):.1f} | {c['cached_token_share']:.1%} |")
    return "\n".join(lines)


def format_contest(result: dict) -> str:
    lines = [(f"contest: {result['workers']} workers, cost model {result['cost_model']}, mix {result['mix']}, "
              f"window {result['window_s']} s; each peer at the rate where it meets {result['attainment']:.0%} "
              f"of its SLOs, against {result['duet_stack']} there; best peer: {result['best_peer']}"), "",
             "| peer | rate | peer goodput req/s (SLO met, cached) | Duet goodput req/s (SLO met, cached) | Duet / peer |",
             "|---|---|---|---|---|"]
    for name, r in result["peers"].items():
        p, d = r["peer"], r["duet"]
        lines.append(f"| {name} | x{r['rate']} | {p['goodput_rps']} ({p['slo_attainment']:.1%}, "
                     f"{p['cached_token_share']:.1%}) | {d['goodput_rps']} ({d['slo_attainment']:.1%}, "
                     f"{d['cached_token_share']:.1%}) | {r['goodput_ratio']} |")
    return "\n".join(lines)
