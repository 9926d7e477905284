"""The flags of `duet bench fleet-calibrate` (loadtests/cli.py adds them); argparse only, each measurement
imports lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("fleet-calibrate", help="measure the real ModelRunner's step times and fit the cpu cost model",
                       description="Times the real ModelRunner at prefill, decode and mixed batch shapes and fits "
                       "the cpu cost model (loadtests/sim/calibrate/steps.py), written to this machine's fit in the "
                       "user cache, which the simulator then reads on this machine (loadtests/sim/fleet/cpu_fit.py).")
    c.add_argument("--model", default=None, help="checkpoint (default: the local stack's SmolLM2-shaped one)")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="what the workers compute in, as their --dtype (default auto: what `duet up` picks here, "
                   "bf16 on a CPU with AMX or AVX512_BF16); --validate starts its stack at the fit's dtype")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--clock", default="wall", choices=("wall", "thread"), help="time each step by the wall clock "
                   "(default) or, with --threads 1, by the thread's CPU time: on a machine other processes load, "
                   "about what the wall clock reads on a quiet one (the fit records which)")
    c.add_argument("--quick", action="store_true", help="time 14 of the 33 step shapes (their corners: "
                   "steps.quick_shapes), for a machine that cannot spare the full calibration; the fit's `how` says so")
    c.add_argument("--out", default=None, help="where to write the fit (default: this machine's own in the user cache, "
                   "<cache>/cpu-cost/<vendor>-f<family>-m<model>.json; the repository's default is "
                   "loadtests/sim/fleet/cpu_cost.json)")
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


def _section_target(args: argparse.Namespace):
    """The fit a section measurement adds to (--out, else this machine's own), which must hold a step fit: the
    sections are measured against its steps, dtype and threads. The process then reads that fit throughout."""
    from pathlib import Path

    from loadtests.sim.fleet.cpu_fit import COST_FILE_ENV, machine_fit_path

    out = Path(args.out) if args.out else machine_fit_path()
    if not out.is_file() or "coefficients" not in json.loads(out.read_text()):
        raise ValueError(f"{out} holds no step fit: run `duet bench fleet-calibrate"
                         f"{' --out ' + args.out if args.out else ''}` first")
    os.environ[COST_FILE_ENV] = str(out)  # every reader of this process and the stacks it starts: this fit
    return out


def _run_calibrate(args: argparse.Namespace) -> int:
    from loadtests.sim.calibrate.steps import measure

    if args.in_situ:
        from loadtests.sim.calibrate.in_situ import measure_in_situ

        print(json.dumps(measure_in_situ(_section_target(args), _progress), indent=2))
        return 0
    if args.neighbour:
        from loadtests.sim.calibrate.neighbour import measure_neighbour

        print(json.dumps(measure_neighbour(args.repeats, _section_target(args), _progress), indent=2))
        return 0
    if args.gateway:
        from loadtests.sim.calibrate.gateway_timing import measure_gateway

        if args.gateway_requests < 1:
            raise ValueError("--gateway-requests must be >= 1")
        section = measure_gateway(args.gateway_requests, out=_section_target(args), progress=_progress)
        print(json.dumps(section, indent=2))
        return 0
    if args.threads < 1 or args.repeats < 1:
        raise ValueError("--threads and --repeats must be >= 1")
    from loadtests.sim.calibrate.steps import quick_shapes

    result = measure(args.model, args.threads, args.repeats, args.out, _progress, dtype=args.dtype,
                     shapes=quick_shapes() if args.quick else None, clock=args.clock)
    print(json.dumps({k: result[k] for k in ("out", "model", "cpu", "dtype", "threads", "clock", "coefficients",
                                             "fit_relative_error")}, indent=2))
    return 0
