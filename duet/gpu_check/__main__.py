"""`python -m duet.gpu_check [--out DIR] [--wheels DIR] [--model M] [--only/--skip STEPS] [--cpu-serve]`
(`make gpu-check`): one prepared check of the GPU path, every step's result as JSON under one folder.

Steps, in order of what matters most when time is short: environment (what the machine has; installs the
pinned packages it lacks), kernel_tests, cuda_graph_tests, serve (`duet up --device cuda` + the openai SDK),
engine_bench, kernel_bench, extend_tune, tensor_parallel_tests, calibrate_8b. Each writes `NN-step.json`
(status passed / failed / skipped with its reason, seconds, figures); `summary.json` holds them all. The whole
check keeps to a budget (default 480 s): a step gets at most its own limit and what is left, and is skipped
when under 20 s are left. Without CUDA every GPU step is skipped, saying so, and the check passes (exit 0) if
the environment does; exit 1 if any step failed.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from duet.gpu_check import environment, serve, steps
from duet.gpu_check.context import Context
from duet.gpu_check.report import Outcome, Record, run_step, write_json

ROOT = Path(__file__).resolve().parents[2]
MIN_STEP_S = 20.0

# name, what it proves, its own time limit (s), whether it needs CUDA, the step
STEPS: list[tuple[str, str, float, bool, Callable[[Context, float], Outcome]]] = [
    ("kernel_tests", "the kernel tests compiled for real, tensors on the GPU", 240, True, steps.kernel_tests),
    ("cuda_graph_tests", "decode steps replayed from CUDA graphs equal eager ones", 120, True,
     steps.cuda_graph_tests),
    ("serve", "duet up --device cuda (cpu with --cpu-serve) under the openai SDK", 300, True, serve.serve),
    ("engine_bench", "engine_paged on CUDA (loadtests.engine_bench paged --quick)", 180, True, steps.engine_bench),
    ("kernel_bench", "kernel times and the H200 targets", 150, True, steps.kernel_bench),
    ("extend_tune", "the extend-attention tile sweep (engine_core.kernels.tune)", 150, True, steps.extend_tune),
    ("tensor_parallel_tests", "tensor-parallel parity over NCCL", 180, True, steps.tensor_parallel_tests),
    ("calibrate_8b", "Llama-3.1-8B-shaped step times against the h200 roofline", 240, True, steps.calibrate_8b),
]
STEP_NAMES = ["environment", *(s[0] for s in STEPS)]


def _names(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(STEP_NAMES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown steps {sorted(unknown)}; steps: {', '.join(STEP_NAMES)}")
    return names


def environment_step(ctx: Context, timeout_s: float, install: str = "auto") -> Outcome:
    machine = {k: ctx.machine.get(k) for k in ("torch", "triton", "cuda_version", "devices", "error")}
    figures = {"python": sys.version.split()[0], **machine}
    do_install = install == "always" or (install == "auto" and ctx.cuda)
    report = environment.resolve(environment.project_needs(ctx.root), ctx.wheels, do_install)
    figures.update(report)
    if ctx.machine.get("error"):
        return Outcome("failed", ctx.machine["error"], figures)
    if report["problems"]:
        hint = "" if do_install else " (nothing installed: --install never, or no CUDA without --install always)"
        return Outcome("failed", "; ".join(report["problems"]) + hint, figures)
    return Outcome("passed", "", figures)


def skip_reason(ctx: Context, name: str, needs_cuda: bool, selected: bool) -> str | None:
    if not selected:
        return "not selected (--only / --skip)"
    if needs_cuda and not ctx.cuda and not (name == "serve" and ctx.cpu_serve):
        why = ctx.machine.get("error") or "torch.cuda.is_available() is False"
        hint = "; --cpu-serve runs it on the CPU with the tiny model" if name == "serve" else ""
        return f"no CUDA device ({why}){hint}"
    if ctx.time_left() < MIN_STEP_S:
        return f"the check's time budget was spent ({MIN_STEP_S:.0f}s or less left)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duet.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check", help="folder for the JSON records")
    parser.add_argument("--wheels", type=Path, default=None, help="wheel folder for what the machine lacks")
    parser.add_argument("--install", choices=["auto", "always", "never"], default="auto",
                        help="pip-install missing or mismatched packages: auto = on a CUDA machine only")
    parser.add_argument("--model", default=None, help="what `duet up` serves (default: the default model)")
    parser.add_argument("--only", type=_names, default=None, help="comma-separated steps to run")
    parser.add_argument("--skip", type=_names, default=set(), help="comma-separated steps to leave out")
    parser.add_argument("--cpu-serve", action="store_true", help="run the serve step without CUDA too")
    parser.add_argument("--budget-s", type=float, default=480.0, help="time for the whole check")
    args = parser.parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("[0-9][0-9]-*.json"):  # a record left from an earlier run would mislead
        old.unlink()
    ctx = Context(root=ROOT, out=args.out.resolve(), machine=environment.probe_torch(),
                  deadline=started + args.budget_s, wheels=args.wheels.resolve() if args.wheels else None,
                  model=args.model, cpu_serve=args.cpu_serve)

    def selected(name: str) -> bool:
        return (args.only is None or name in args.only) and name not in args.skip

    records: list[Record] = []
    first = ("environment", "what the machine has against what the project pins", 300, False,
             functools.partial(environment_step, install=args.install))
    for index, (name, title, limit, needs_cuda, fn) in enumerate([first, *STEPS]):
        reason = skip_reason(ctx, name, needs_cuda, selected(name))
        if reason:
            step = functools.partial(Outcome, "skipped", reason)
        else:
            step = functools.partial(fn, ctx, min(limit, ctx.time_left()))
        record = run_step(name, title, step, ctx.out, index)
        records.append(record)
        print(f"gpu-check: {name:22} {record.status:8} {record.seconds:7.1f}s  {record.reason[:160]}", flush=True)
    counts = {s: sum(r.status == s for r in records) for s in ("passed", "failed", "skipped")}
    summary = {"command": "python -m duet.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
               "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": ctx.machine,
               "cuda": ctx.cuda, "seconds": round(time.monotonic() - started, 1), **counts,
               "steps": [asdict(r) for r in records]}
    write_json(ctx.out / "summary.json", summary)
    print(f"gpu-check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in "
          f"{summary['seconds']}s; records in {ctx.out}", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
