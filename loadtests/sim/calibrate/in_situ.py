"""`duet bench fleet-calibrate --in-situ`: how much slower the step fit's steps run inside the running stack than
in the runner alone, measured on a window of the trace that `--validate` does not use.

The step fit (steps.py) times the ModelRunner alone in one process. A worker of the local stack runs the same
forward with its gRPC server, its output streaming and the gateway's load polls on the same core, while the gateway
and the load client take CPU wherever they run: `--validate`'s step check found the served forward at about 1.1x
the fit on decode and up to 1.4x on prefill. This command runs the pinned stack `--validate` runs, at its rate,
on a later window of the mixed trace that `--validate` does not use (so the factors are not fitted to the run
they are judged on): trace seconds [330, 390), chosen for its shape, 158 chat turns and 64 documents against the
validation window's 162 and 63 (the Azure trace is bursty: [60, 180) holds no document, [240, 300) three times the
validation's). It reads the workers' step traces and writes the cpu fit's `in_situ` section (sim/fleet/cpu_fit.py):

- `prefill`, `decode`, `mixed`: per step kind, the median of forward / fit over the steps that ran while the
  other worker was idle (all the kind's steps where none did);
- `neighbour_slowdown`: over the steps that ran while the other worker was mid-step, the median of
  forward / fit / its kind's factor, minus one. It is wall-clock time, so unlike `--neighbour`'s CPU-time figure
  it includes the gateway and the client taking time from a busy core;
- `by_engine`: the same three factors per engine kind (engine_paged's worker against engine_prefix's), each where
  that worker ran at least MIN_STEPS steps of the step kind. On the Zen 4 VM the all-workers decode factor was
  the prefix worker's chat decode steps, and the paged worker's document decode ran about 25% slower than that
  (docs/benchmarks.md), so one factor per step kind misplaced a quarter of the paged worker's time.

`--validate` simulates with the fit times these factors (cost_models.InSituCostModel) and this slowdown.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from loadtests.sim.fleet.cost_models import STEP_KINDS

START_S = 330.0  # the held-out window's start in trace seconds (module docstring)
MIN_STEPS = 10  # an engine kind's own factor for a step kind needs this many of its steps of that kind


def _factor(rows, kind: str) -> float | None:
    """The median forward / fit of `kind`'s steps that ran with the neighbour idle (all of them where none did)."""
    ratios = [r[2] / r[3] for r in rows if r[0] == kind and not r[1]] or [r[2] / r[3] for r in rows if r[0] == kind]
    return round(statistics.median(ratios), 4) if ratios else None


def in_situ_factors(steps_by_worker: dict, engine_of: dict | None = None) -> dict:
    """The section's figures from step_check.classified_steps' rows: (kind, neighbour busy, forward s, fit s, step s);
    `engine_of` (worker key -> engine kind) adds `by_engine`."""
    kept = {key: [r for r in steps if r[3] > 0] for key, steps in steps_by_worker.items()}
    rows = [r for steps in kept.values() for r in steps]
    factors = {kind: _factor(rows, kind) or 1.0 for kind in STEP_KINDS}
    busy = [r[2] / r[3] / factors[r[0]] for r in rows if r[1]]
    steps = {kind: sum(1 for r in rows if r[0] == kind) for kind in STEP_KINDS}
    section = {**factors, "neighbour_slowdown": round(max(0.0, statistics.median(busy) - 1.0), 4) if busy else 0.0,
               "steps": steps, "steps_with_neighbour_busy": len(busy)}
    if engine_of:
        by_engine = {}
        for engine in sorted(set(engine_of.values())):
            own = [r for key, steps in kept.items() if engine_of.get(key) == engine for r in steps]
            by_engine[engine] = {kind: _factor(own, kind) for kind in STEP_KINDS
                                 if sum(1 for r in own if r[0] == kind) >= MIN_STEPS}
        section["by_engine"] = by_engine
    return section


def measure_in_situ(out: Path, progress=None) -> dict:
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.step_check import classified_steps
    from loadtests.sim.fleet.validate import ValidateSettings, local
    from loadtests.sim.fleet.workload import MIXES, build

    s = ValidateSettings()
    requests = build(MIXES["mixed"], s.window_s, s.rate, EngineProfile.for_cost_model("cpu").max_model_len,
                     max_output_tokens=s.max_output_tokens, max_prompt_tokens=s.max_prompt_tokens, start_s=START_S)
    with tempfile.TemporaryDirectory(prefix="duet-in-situ-trace-") as tmp:
        figures, pids, _ = local(requests, s, progress, Path(tmp))
        # ServingStack names each worker "<kind>-<slot>" (loadtests/stack/serving.py): "paged-0" -> "paged"
        engine_of = {pid: worker_id.split("-")[0] for pid, worker_id in pids.items()}
        section = in_situ_factors(classified_steps(Path(tmp)), engine_of)
    section["how"] = (f"duet bench fleet-calibrate --in-situ (loadtests/sim/calibrate/in_situ.py): the pinned stack "
                      f"on trace seconds [{START_S:g}, {START_S + s.window_s:g}) of the mixed workload at x{s.rate:g}, "
                      f"{figures['completed']} of {figures['requests']} requests completed")
    section["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    fit = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    fit["in_situ"] = section
    Path(out).write_text(json.dumps(fit, indent=1) + "\n")
    return section
