"""`duet bench chaos`: its flags, and the drill (loadtests/experiments/chaos.py) imported lazily."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos",
        help="fault drill: kill/freeze workers, restart Redis, kill a gateway, under load and fuzzed input",
        description="Starts a local stack (engine_paged + engine_prefix on the tiny model, two gateways sharing a "
        "private Redis, all supervised), runs mixed traffic and hostile bodies while it kills a worker (-9), "
        "freezes one longer than the stall timeout, restarts Redis and kills a gateway; prints requests, ok, "
        "clean_errors, lost, hung, leaked_pages, rss_growth_mb and recovery_s per fault.",
    )
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--clients", type=int, default=None, help="concurrent request loops")
    p.add_argument("--soak", type=float, default=0.0, metavar="MINUTES",
                   help="repeat the fault cycle for this long (default: one cycle)")
    p.add_argument("--stall-s", type=float, default=None, help="the gateways' stall timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="keep the stack's logs here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from loadtests.experiments.chaos import ChaosSettings, run
    from loadtests.stack.serving import StackError

    s = replace(ChaosSettings(), soak_minutes=args.soak, seed=args.seed,
                **{k: v for k, v in (("clients", args.clients), ("stall_s", args.stall_s)) if v is not None})
    try:
        result = run(s, args.model, args.log_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except StackError as e:
        print(f"duet bench chaos: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=None if args.json else 2))
    clean = result["lost"] == 0 and result["hung"] == 0 and not any(result["leaked_pages"].values())
    return 0 if clean else 1
