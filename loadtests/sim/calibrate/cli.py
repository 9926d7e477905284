"""The flags of `duet bench fleet-calibrate` (loadtests/cli.py adds them); argparse only, each measurement
imports lazily."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("fleet-calibrate", help="measure the real ModelRunner's step times and fit the cpu cost model",
                       description="Times the real ModelRunner at prefill, decode and mixed batch shapes and fits "
                       "loadtests/sim/fleet/cpu_cost.json (loadtests/sim/calibrate/steps.py).")
    c.add_argument("--model", default=None, help="checkpoint (default: the local stack's SmolLM2-shaped one)")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--out", default=None, help="where to write the fit (default: loadtests/sim/fleet/cpu_cost.json)")
    c.add_argument("--gateway", action="store_true", help="instead of the step fit, measure the gateway path "
                   "(request and token times through the local stack's gateway: loadtests/sim/calibrate/gateway_timing.py) "
                   "into the fit's `gateway` section")
    c.add_argument("--gateway-requests", type=int, default=12, help="--gateway: requests to time")
    c.add_argument("--neighbour", action="store_true", help="instead of the step fit, measure how much slower a step "
                   "runs while the other core steps too (loadtests/sim/calibrate/neighbour.py) into the fit's "
                   "`neighbour_slowdown`")
    c.add_argument("--in-situ", action="store_true", help="instead of the step fit, measure how much slower its steps "
                   "run inside the pinned local stack, on a trace window --validate does not use "
                   "(loadtests/sim/calibrate/in_situ.py), into the fit's `in_situ` section (~2 min)")
    c.set_defaults(func=_run_calibrate)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadtests.sim.calibrate.steps import measure
    from loadtests.sim.fleet.cost_models import CPU_FIT

    if args.in_situ:
        from loadtests.sim.calibrate.in_situ import measure_in_situ

        print(json.dumps(measure_in_situ(Path(args.out) if args.out else CPU_FIT, _progress), indent=2))
        return 0
    if args.neighbour:
        from loadtests.sim.calibrate.neighbour import measure_neighbour

        print(json.dumps(measure_neighbour(args.repeats, Path(args.out) if args.out else CPU_FIT, _progress), indent=2))
        return 0
    if args.gateway:
        from loadtests.sim.calibrate.gateway_timing import measure_gateway

        if args.gateway_requests < 1:
            raise ValueError("--gateway-requests must be >= 1")
        section = measure_gateway(args.gateway_requests, out=Path(args.out) if args.out else CPU_FIT,
                                  progress=_progress)
        print(json.dumps(section, indent=2))
        return 0
    if args.threads < 1 or args.repeats < 1:
        raise ValueError("--threads and --repeats must be >= 1")
    result = measure(args.model, args.threads, args.repeats, Path(args.out) if args.out else CPU_FIT, _progress)
    print(json.dumps({k: result[k] for k in ("model", "threads", "coefficients", "fit_relative_error")}, indent=2))
    return 0
