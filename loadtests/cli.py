"""`duet bench ...`: the load-test commands. duet/cli.py hands `duet bench` its arguments here. Each command
registers through its own module's `add_parser` (argparse only at import; its run imports lazily), listed
here in the order `duet bench --help` shows them."""

from __future__ import annotations

import argparse
import os
import sys

from loadtests.advise.cli import add_parser as add_advise
from loadtests.experiments.baseline import add_parser as add_baseline
from loadtests.experiments.chaos_cli import add_parser as add_chaos
from loadtests.experiments.classes_cli import add_parser as add_classes
from loadtests.experiments.compare_cli import add_parser as add_compare
from loadtests.experiments.engine_diff import add_parser as add_diff
from loadtests.experiments.peer import add_parser as add_peer
from loadtests.experiments.routers import add_parser as add_routers
from loadtests.load.bench_run import add_parser as add_run
from loadtests.sim.calibrate.cli import add_parser as add_fleet_calibrate
from loadtests.sim.fleet.cli import add_parser as add_fleet
from loadtests.sim.routing.cli import add_parser as add_simulate_routing

COMMANDS = (add_simulate_routing, add_compare, add_classes, add_chaos, add_advise, add_run, add_peer, add_routers,
            add_baseline, add_diff, add_fleet, add_fleet_calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet bench", description="Duet load tests and simulations")
    parser.add_argument("--trace-dir", default=None, help="read the named traces (mooncake, azure_code, azure_conv) "
                        "from this folder instead of the shipped ones (the same as DUET_TRACE_DIR)")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trace_dir:
        from loadtests.traces import shipped

        os.environ[shipped.ENV] = args.trace_dir  # read by every command, in this process and its children
    try:
        return args.func(args)
    except ValueError as e:  # bad input (trace, flags, routing config): one clear line
        print(f"duet bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
