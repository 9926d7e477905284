"""The GPU check's test and benchmark steps, each a command whose result becomes one record (report.py).

Kernel tests compiled for real (no TRITON_INTERPRET, tensors on the GPU; the tests about CPU tensors
deselected), the CUDA-graph tests (none may skip on a CUDA machine), the tensor-parallel parity tests (two or more
GPUs), the kernel bench (its targets must pass), the extend tile sweep, the engine bench on CUDA and the 8B step
times against the h200 roofline. Each writes its full output beside the records and keeps the headline figures.
"""

from __future__ import annotations

import json
import statistics

from duet.gpu_check.context import Context
from duet.gpu_check.report import Outcome, Ran, junit_counts, run_command, write_json

# the kernel tests that are about CPU tensors or the CPU reference (make gpu-check has always left them out)
KERNEL_TESTS_DESELECT = ("not test_cpu_report_has_reference_timings and not test_cpu_tensors_use_the_reference"
                         " and not test_forcing_triton_on_cpu")


def _pytest(ctx: Context, name: str, args: list[str], timeout_s: float, env: dict,
            none_may_skip: bool = False) -> Outcome:
    xml = ctx.logs / f"{name}.xml"
    argv = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    ran = run_command(argv, ctx.logs / f"{name}.log", timeout_s, env, ctx.root)
    counts = junit_counts(xml)
    details = {"command": "python " + " ".join(argv[1:]), "log": ctx.rel(ran.log)}
    if ran.timed_out:
        return Outcome("failed", f"timed out after {timeout_s:.0f}s", counts, details)
    if ran.rc != 0:
        failed = counts.get("failures", 0) + counts.get("errors", 0)
        return Outcome("failed", f"pytest exit {ran.rc}: {failed} failed: {', '.join(counts.get('failed_tests', []))}"
                       if failed else f"pytest exit {ran.rc}: {ran.tail(3)}", counts, details)
    if none_may_skip and counts.get("skipped"):
        return Outcome("failed", f"{counts['skipped']} tests skipped on a CUDA machine", counts, details)
    return Outcome("passed", "", counts, details)


def kernel_tests(ctx: Context, timeout_s: float) -> Outcome:
    env = ctx.env(unset=("TRITON_INTERPRET",), DUET_KERNEL_TEST_DEVICE="cuda")
    return _pytest(ctx, "kernel_tests", ["tests/kernels", "-k", KERNEL_TESTS_DESELECT], timeout_s, env)


def cuda_graph_tests(ctx: Context, timeout_s: float) -> Outcome:
    return _pytest(ctx, "cuda_graph_tests", ["tests/engine_core/test_cuda_graphs.py"], timeout_s,
                   ctx.env(unset=("TRITON_INTERPRET",)), none_may_skip=True)


def tensor_parallel_tests(ctx: Context, timeout_s: float) -> Outcome:
    if ctx.gpus < 2:
        return Outcome("skipped", f"needs 2 or more GPUs; this machine has {ctx.gpus}")
    env = ctx.env(unset=("TRITON_INTERPRET",), DUET_TP_TEST_DEVICE="cuda")
    return _pytest(ctx, "tensor_parallel_tests", ["tests/engine_core/test_tensor_parallel.py"], timeout_s, env)


def _json_command(ctx: Context, name: str, module_args: list[str], timeout_s: float) -> tuple[Ran, dict | None, dict]:
    """Run `python -m ...` that prints one JSON document; keep it as `name.json` beside the records."""
    argv = [ctx.python, "-m", *module_args]
    ran = run_command(argv, ctx.logs / f"{name}.log", timeout_s, ctx.env(unset=("TRITON_INTERPRET",)), ctx.root,
                      capture_stdout=True)
    details = {"command": "python " + " ".join(argv[1:]), "log": ctx.rel(ran.log)}
    if ran.rc != 0:
        return ran, None, details
    try:
        data = json.loads(ran.stdout)
    except json.JSONDecodeError:
        return ran, None, details
    write_json(ctx.out / f"{name}.json", data)
    details["data"] = f"{name}.json"
    return ran, data, details


def _failed_run(ran: Ran, timeout_s: float, details: dict) -> Outcome:
    if ran.timed_out:
        why = f"timed out after {timeout_s:.0f}s"
    else:
        why = f"exit {ran.rc}: {ran.tail(3)}" if ran.rc else "exit 0 but stdout was not one JSON document"
    return Outcome("failed", why, details=details)


def kernel_bench(ctx: Context, timeout_s: float) -> Outcome:
    ran, data, details = _json_command(ctx, "kernel_bench", ["engine_core.kernels.bench", "--json"], timeout_s)
    if data is None:
        return _failed_run(ran, timeout_s, details)
    rows = [{k: r.get(k) for k in ("kernel", "shape", "triton_ms", "triton_rate", "unit", "speedup_vs_torch")}
            for r in data["results"]]
    figures = {"device": data["device"], "peaks": data.get("peaks"), "targets": data["targets"], "results": rows}
    missed = [t["target"] for t in data["targets"] if not t["pass"]] if isinstance(data["targets"], list) else []
    if missed:
        return Outcome("failed", "targets missed: " + "; ".join(missed), figures, details)
    return Outcome("passed", "", figures, details)


def extend_tune(ctx: Context, timeout_s: float) -> Outcome:
    ran, data, details = _json_command(ctx, "extend_tune", ["engine_core.kernels.tune", "extend", "--json"],
                                       timeout_s)
    if data is None:
        return _failed_run(ran, timeout_s, details)
    default = next((r for r in data["tiles"] if r["tile"] == data["default_tile"]["gpu"]), None)
    figures = {"best": data.get("best"), "passed": data["passed"], "failed": data["failed"],
               "default_tile": data["default_tile"]["gpu"], "default_tile_shapes": default and default["shapes"],
               "statuses": {"x".join(map(str, r["tile"])): r["status"] for r in data["tiles"]}}
    return Outcome("passed", "", figures, details)


def engine_bench(ctx: Context, timeout_s: float) -> Outcome:
    ran, data, details = _json_command(
        ctx, "engine_bench", ["loadtests.engine_bench", "paged", "--quick", "--json", "--device", "cuda"], timeout_s)
    if data is None:
        return _failed_run(ran, timeout_s, details)
    figures = {k: v for k, v in data.items() if isinstance(v, (int, float, str, bool))}
    return Outcome("passed", "", figures, details)


def calibrate_8b(ctx: Context, timeout_s: float) -> Outcome:
    ran, data, details = _json_command(
        ctx, "calibrate_8b", ["loadtests.sim.calibrate.h200", "--json", "--repeats", "3"], timeout_s)
    if data is None:
        return _failed_run(ran, timeout_s, details)
    ratios = [p["measured_over_roofline"] for p in data["points"]]
    figures = {"ceilings": data.get("ceilings"), "points": len(ratios),
               "measured_over_roofline": {"min": min(ratios), "max": max(ratios),
                                          "mean": round(statistics.mean(ratios), 3)} if ratios else None,
               "steps_ms": {json.dumps(p["chunks"]): round(p["seconds"] * 1e3, 2) for p in data["points"]}}
    return Outcome("passed", "", figures, details)
