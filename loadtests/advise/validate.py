"""`duet bench advise --validate`: is advise's prediction for a trace (a gateway's capture) true on this machine?

advise runs the fleet simulator on the `cpu` cost model (the fit loadtests/sim/fleet/cpu_fit.py names: this
machine's own after `duet bench fleet-calibrate`, or `--cost-file`; the answer's `cost_fit` says whether it
describes this machine) at the local stack's size; the deployment it recommends is then run for real by the
validation `duet bench fleet --validate` already does (loadtests/sim/fleet/validate.local: the recommended
kinds pinned one per core at the fit's dtype and threads, behind the recommended router, the requests sent by
the benchmark client at their arrival times), on the very requests advise simulated: the capture's input and
output lengths, its arrival times and its shared prefixes (each block hash a fixed run of token ids, so
requests that shared a block share those tokens). Advise's predicted goodput and TTFT p50 for that option are
printed beside the measured ones, with measured / predicted and the relative error against the 15% target,
both judged by the same per-class SLOs over the same arrival span, with each worker's traced forwards over the
fit's seconds (sim/fleet/step_check.py): near 1 where the machine ran its steps as when the fit was measured,
above where it was busier.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

TARGET = 0.15  # the bound on |predicted - measured| / measured
FIGURES = ("goodput_rps", "ttft_p50_s")


def option_spec(settings, name: str):
    """The recommended option's StackSpec, as the simulator ran it."""
    from loadtests.advise.fleet import options_settings
    from loadtests.sim.fleet.bench import specs

    for spec in specs(options_settings(settings)):
        if spec.name == name:
            return spec
    raise ValueError(f"advise recommended {name!r}, which is not among the simulated options")


def deployment_of(settings, name: str) -> tuple[tuple[str, ...], str]:
    """The recommended option's worker kinds and router ("duet" or "sglang"), as the simulator ran it."""
    spec = option_spec(settings, name)
    return spec.kinds, spec.policy


def simulated_served(settings, name: str) -> list:
    """The recommended option's simulated requests at the given traffic (advise's own run again: deterministic)."""
    from loadtests.advise.fleet import options_settings
    from loadtests.sim.fleet.bench import stack_sim

    sim, _ = stack_sim(option_spec(settings, name), options_settings(settings))
    return sim.run()


def _compare(predicted, measured) -> dict:
    if predicted is None or measured is None:
        return {"predicted": predicted, "measured": measured, "ratio": None, "error": None, "within_target": None}
    ratio = measured / predicted if predicted else None
    error = abs(predicted - measured) / measured if measured else None  # none measured: no relative error,
    within = error <= TARGET if error is not None else predicted == measured  # and only a prediction of none is right
    return {"predicted": predicted, "measured": round(measured, 4), "ratio": None if ratio is None else float(f"{ratio:.4g}"),
            "error": None if error is None else float(f"{error:.4g}"), "within_target": within}


def validate_advice(advice: dict, settings, model: str | None = None, progress=None,
                    per_request: Path | None = None) -> dict:
    """Run advice's recommended deployment locally on the workload `settings` describe (the FleetSettings advise
    ran at the given traffic); advise's figures for that option beside the measured ones; with `per_request`,
    both sides of every request as JSON lines there (sim/fleet/validate.per_request_rows)."""
    from loadtests.load.class_slo import FLEET_SLOS
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.step_check import step_cost_check
    from loadtests.sim.fleet.validate import ValidateSettings, local, per_request_rows, stack_limits
    from loadtests.sim.fleet.workload import build

    name = advice["recommendation"]["deployment"]
    option = advice["rates"]["traffic"]["options"][name]
    kinds, router = deployment_of(settings, name)
    profile = EngineProfile.for_cost_model(settings.cost_model)
    requests = build(settings.mix, settings.window_s, settings.rate, profile.max_model_len,
                     max_output_tokens=settings.max_output_tokens)
    vs = ValidateSettings(kinds=kinds, router=router, model=model,
                          slos=settings.slos or FLEET_SLOS[settings.cost_model])
    if progress:
        progress(f"validating {name} ({' + '.join(kinds)}, {router} router) on {len(requests)} requests")
    _, limits = stack_limits(model)  # the dtype and threads the fit timed, which the stack runs (cpu_fit.py)
    with tempfile.TemporaryDirectory(prefix="duet-advise-validate-trace-") as tmp:
        measured, pids, records = local(requests, vs, progress, Path(tmp))
        # each worker's traced forwards against the fit: whether the machine ran the steps as fast as when the fit
        # was measured (a loaded machine: slower), so a miss can be told from the simulator's error
        steps = step_cost_check(Path(tmp), pids)
    if per_request is not None:
        rows = per_request_rows(simulated_served(settings, name), records)
        Path(per_request).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"deployment": name, "kinds": list(kinds), "router": router, "requests": len(requests),
            "errors": sum(1 for r in records if not r.ok), "target": TARGET,
            "model": model or "the SmolLM2-shaped checkpoint (the cpu fit's)",
            "dtype": limits.dtype, "threads": limits.torch_threads,
            **{key: _compare(option[key], measured[key]) for key in FIGURES},
            "local_steps_vs_cpu_model": steps}


def format_validation(v: dict) -> str:
    head = (f"## Validation: {v['deployment']} ({' + '.join(v['kinds'])}, {v['router']} router) run on this "
            f"machine, {v['requests']} requests, {v['errors']} errors"
            + (f", workers at {v['dtype']} and {v['threads']} thread(s) (the cpu fit's)" if "dtype" in v else ""))
    lines = ["", head, "",
             f"| figure | advise predicted | measured | measured / predicted | error (target <= {v['target']:.0%}) |",
             "|---|---|---|---|---|"]
    for key in FIGURES:
        f = v[key]
        where = "within" if f["within_target"] else "outside"
        verdict = f"{f['error']:.1%} ({where})" if f["error"] is not None else f"- ({where})"
        lines.append(f"| {key} | {f['predicted']} | {f['measured']} | {f['ratio']} | {verdict} |")
    steps = v.get("local_steps_vs_cpu_model") or {}
    if steps:
        lines += ["", ("Each worker's traced forwards over the fit's seconds, median by step kind (near 1: the machine "
                  "ran the steps as when the fit was measured; above: slower, e.g. busier):")]
        for worker, w in sorted(steps.items()):
            kinds = ", ".join(f"{kind} {f['forward_over_model_median']} ({f['steps']} steps)"
                              for kind, f in sorted(w.items()) if isinstance(f, dict))
            lines.append(f"- {worker}: {kinds or 'no steps'}")
    return "\n".join(lines) + "\n"
