"""`duet bench compare`: its flags and the Settings they make (loadtests/experiments/compare.py runs it).
argparse only at import: `duet bench` builds every subcommand's parser, the run imports lazily."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="the headline experiment: all-paged vs all-prefix vs duet (fixed and planned) on one mixed workload",
        description="Starts four stacks of the same size on the same checkpoint, one after the other: all "
        "engine_paged and all engine_prefix behind cache-aware routing, half of each behind Duet's routing, and "
        "Duet with the pool planner switching kinds; sends each the same mixed workload (multi-turn chats, agent "
        "loops, unrelated long documents; Poisson arrivals) at three rates with repeats, and reports goodput and "
        "TTFT per traffic class (loadtests/experiments/compare.py). With no options: the headline run.",
    )
    p.add_argument("--model", default=None,
                   help="model directory (default: a random checkpoint of SmolLM2-135M's shape, made once)")
    p.add_argument("--workers", type=int, default=None, help="workers per stack (default 4; duet: half of each kind)")
    p.add_argument("--quick", action="store_true", help="a small check of the machinery (2 workers, light rate)")
    p.add_argument("--num-requests", type=int, default=None, help="per run (default: rate x 120 s)")
    p.add_argument("--rates", default=None,
                   help="comma-separated: light, medium, heavy or numbers (arrivals/s: conversations + documents)")
    p.add_argument("--repeats", type=int, default=None, help="runs per rate (default: 3 at medium, 1 at the others)")
    p.add_argument("--mix", default=None, help="class shares, e.g. multi_turn=2,agent=1,long_doc=1 (default 1:1:1)")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT bound of goodput (default 5000)")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="bound on a request's mean inter-token latency (default 250)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="per worker, every stack alike (default 4096)")
    p.add_argument("--configs", default=None, help="comma-separated subset of all_paged,all_prefix,duet_fixed,duet_planner")
    p.add_argument("--pin-cores", action="store_true",
                   help="worker i on core i (default 2 workers: one per core here) and per-class SLOs")
    p.add_argument("--class-slo", default=None,
                   help="per-class TTFT bounds in ms, e.g. long_doc=8000,multi_turn=1500 (implies per-class SLOs)")
    p.add_argument("--log-dir", default=None, help="keep the stacks' logs here (default: temp dirs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_run)


def compare_settings(args: argparse.Namespace):
    """The Settings the parsed flags describe (tests check this without starting a stack)."""
    from dataclasses import replace

    from loadtests.experiments import compare
    from loadtests.load.class_slo import ClassSlo, parse_class_slos
    from loadtests.load.workloads import parse_shares

    s = compare.QUICK if args.quick else compare.Settings()
    if args.pin_cores:
        s = replace(s, pin_cores=True, workers=2, class_slo=ClassSlo())
    given = {k: getattr(args, k) for k in ("model", "workers", "num_requests", "repeats", "max_prompt_tokens",
                                            "max_tokens", "seed")}
    given.update(ttft_slo_ms=args.slo_ttft_ms, itl_slo_ms=args.slo_itl_ms)
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    if args.class_slo:
        s = replace(s, class_slo=parse_class_slos(args.class_slo, s.class_slo))
    if args.rates:
        s = replace(s, rates=tuple(r.strip() for r in args.rates.split(",") if r.strip()))
    if args.mix:
        s = replace(s, shares=tuple(parse_shares(args.mix, tuple(compare.SHARES)).items()))
    if args.kv_cache_tokens is not None:
        s = replace(s, limits=replace(s.limits, kv_cache_tokens=args.kv_cache_tokens))
    if args.configs:
        s = replace(s, configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()))
    return s.validate()


def _run(args: argparse.Namespace) -> int:
    from loadtests.experiments import compare
    from loadtests.experiments.compare_report import format_table

    s = compare_settings(args)
    from loadtests.stack.serving import StackError

    try:
        result = compare.run(s, args.log_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except StackError as e:  # a worker or the gateway did not come up: its log says why
        print(f"duet bench compare: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
