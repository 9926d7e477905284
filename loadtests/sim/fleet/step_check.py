"""`duet bench fleet --validate`'s check of the step model in the running stack: each local worker's traced steps
(engine_core/step_trace.py) against the `cpu` cost model of the same shapes.

Per worker: real forward seconds / modelled seconds (`forward_over_model`, summed and the per-step median) for
prefill-only, decode-only and mixed steps, each also apart for the steps that ran while another worker was
mid-step for most of their time (`*_with_neighbour_busy`: the step fit was measured one runner at a time, with
the other core idle, and the cores share caches and memory bandwidth), and the mean time a step spends outside
the forward (scheduling, sampling, output processing). Near 1.0 the fit held in that run; well above it, the
machine was busier than when the fit was measured and the run's errors are not the simulator's.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def _overlap(step: dict, others: list[tuple[float, float]]) -> float:
    """The share of `step`'s time during which another worker was mid-step (the cores' shared caches and
    memory bandwidth: something the step fit, measured one runner at a time, does not see)."""
    t0, t1 = step["t"], step["t"] + step["step_s"]
    busy = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in others)
    return min(1.0, busy / (t1 - t0)) if t1 > t0 else 0.0


def classified_steps(trace_dir: Path) -> dict[int, list[tuple[str, bool, float, float, float]]]:
    """Each worker's traced steps (by pid) as (kind, neighbour busy, forward s, modelled s, step s): kind is
    prefill, decode or mixed, and the neighbour was busy when another worker was mid-step for most of the step."""
    from engine_core.step_trace import read_traces
    from loadtests.sim.fleet.cost_models import LinearCostModel, shape_of_counts, step_kind

    model = LinearCostModel.from_json()
    traces = read_traces(trace_dir)
    spans = {pid: [(st["t"], st["t"] + st["step_s"]) for st in steps] for pid, steps in traces.items()}
    out = {}
    for pid, steps in traces.items():
        others = [span for other, s in spans.items() if other != pid for span in s]
        out[pid] = [(step_kind(shape := shape_of_counts(st["chunks"])), _overlap(st, others) >= 0.5,
                     st["forward_s"], model.step_seconds(shape), st["step_s"]) for st in steps]
    return out


def step_cost_check(trace_dir: Path, workers: dict[int, str]) -> dict[str, dict]:
    """The module docstring's figures per worker (named by `workers`: pid -> worker id) of the traces in
    `trace_dir`."""
    out = {}
    for pid, steps in classified_steps(trace_dir).items():
        rows = [(kind + ("_with_neighbour_busy" if busy else ""), fwd, model, step)
                for kind, busy, fwd, model, step in steps]
        worker = {"steps": len(rows), "outside_forward_s_per_step": round(
            statistics.fmean(r[3] - r[1] for r in rows), 5) if rows else None}
        for kind in sorted({r[0] for r in rows}):
            sel = [r for r in rows if r[0] == kind]
            worker[kind] = {"steps": len(sel), "forward_over_model_sum": round(
                sum(r[1] for r in sel) / sum(r[2] for r in sel), 3),
                "forward_over_model_median": round(statistics.median(r[1] / r[2] for r in sel), 3)}
        out[workers.get(pid, f"pid {pid}")] = worker
    return out
