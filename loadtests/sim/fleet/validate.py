"""`duet bench fleet --validate`: the same small workload on the local stack and in the fleet simulator (the
`cpu` cost model), and the simulator's relative errors on goodput, TTFT p50 and TPOT p50.

Local: loadtests/stack/serving.ServingStack (the launcher `duet up` uses) with one engine_paged and one
engine_prefix worker on `duet bench compare`'s SmolLM2-shaped checkpoint, one torch thread each, each worker
pinned to its own core (`os.sched_setaffinity` on every thread, as `taskset -a -p` would), behind a gateway with Duet's routing;
the requests sent by the benchmark client (loadtests/load/client.py) at the workload's arrival times,
prompts as token ids. Simulated: the same requests, worker kinds, KV budget and batch limits
(`EngineProfile.for_cost_model("cpu")`, the stack's EngineLimits), Duet's routing, every turn at its own
arrival time as the open-loop client sends it (`chain_sessions=False`), through the measured gateway path
(loadtests/sim/fleet/gateway_path.py: the gateway's FIFO, its token time, routing on the load its 0.5 s poll saw,
at five phases of that poll, each figure their median: the real poll's phase is unknown), each step the fit's
seconds times the factor of its kind measured in the running stack on another window of the trace, the worker's
engine kind's own factor where that was measured (`fleet-calibrate --in-situ`, cpu_cost.json's `in_situ`; the
fit alone where none was).
Both are judged by the cpu profile's SLOs (duet/traffic_classes.py; FLEET_SLOS["cpu"]) over the same arrival span. Error =
|simulated - local| / local. The local workers trace their steps (engine_core/step_trace.py), and
`local_steps_vs_cpu_model` compares each traced step with the cpu model of its shape: the check that says whether
the machine was as quiet as when the fit was measured, and so whether the errors are the simulator's.

The default workload (a minute of the mixed trace at half its rate, prompts cut to 512 tokens, outputs to
32) takes about three minutes on the quiet machine; the `cpu` fit should be measured there first
(`duet bench fleet-calibrate`), since the figures compare this machine with a model of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from duet.contract import ENGINE_KINDS
from loadtests.load.class_slo import FLEET_SLOS
from loadtests.sim.fleet.report import met


@dataclass(frozen=True)
class ValidateSettings:
    window_s: float = 60.0
    rate: float = 0.5
    max_prompt_tokens: int = 512
    max_output_tokens: int = 32
    kinds: tuple[str, ...] = ENGINE_KINDS
    # the local stack's router ("duet" or "sglang": bench.specs' policies), checkpoint (None: the SmolLM2-shaped
    # one the cpu fit was measured on) and SLOs (None: the cpu profile's); `duet bench advise --validate` sets them
    router: str = "duet"
    model: str | None = None
    slos: object = None


@dataclass
class _LocalServed:
    """A client record in the shape report.met reads."""

    req: object
    ttft_s: float
    tpot_s: float
    tokens: int
    done: bool
    prompt_tokens: int


def _median(values):
    return statistics.median(values) if values else None


def _figures(served, span: float, slos=None) -> dict:
    slos = slos or FLEET_SLOS["cpu"]
    done = [s for s in served if s.done]
    return {"requests": len(served), "completed": len(done),
            "goodput_rps": sum(1 for s in done if met(s, slos)) / span,
            "ttft_p50_s": _median([s.ttft_s for s in done]),
            "tpot_p50_s": _median([s.tpot_s for s in done if s.tokens > 1]),
            # the overall median sits between the classes' TTFTs (docs/benchmarks.md): read it with these
            "ttft_p50_s_by_class": {cls: _median([s.ttft_s for s in done if s.req.traffic_class == cls])
                                    for cls in sorted({s.req.traffic_class for s in done})}}


def _error(sim, local):
    if sim is None or local is None or local == 0:
        return None
    return round(abs(sim - local) / local, 4)


def stack_poll_interval_s() -> float:
    """How often the local stack's gateway polls its workers' load (duet.launcher.gateway_config's default,
    which ServingStack keeps)."""
    from duet.launcher import gateway_config

    return inspect.signature(gateway_config).parameters["poll_interval_s"].default


POLL_PHASES = 5  # the simulated gateway's first load poll at this many phases, spread evenly over its interval


def poll_phases() -> list[float]:
    """The phases --validate simulates (gateway_path.py: the real poll's phase is unknown, so none is favoured;
    the middle one is the phase of `--per-request`)."""
    interval = stack_poll_interval_s()
    return [round((k + 0.5) * interval / POLL_PHASES, 4) for k in range(POLL_PHASES)]


def simulated(requests, s: ValidateSettings, served_by_phase: dict[float, list] | None = None) -> dict:
    """Each figure's median over the poll phases, and every phase's own figures (`by_poll_phase`);
    `served_by_phase`: the runs already simulated, by phase (default: simulate them)."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    if served_by_phase is None:
        served_by_phase = {phase: simulated_served(requests, s, phase) for phase in poll_phases()}
    runs = {phase: _figures(served, span) for phase, served in served_by_phase.items()}
    out = {key: _median([r[key] for r in runs.values()]) for key in ("goodput_rps", "ttft_p50_s", "tpot_p50_s")}
    classes = {cls for r in runs.values() for cls in r["ttft_p50_s_by_class"]}
    out["ttft_p50_s_by_class"] = {cls: _median([r["ttft_p50_s_by_class"][cls] for r in runs.values()
                                                if cls in r["ttft_p50_s_by_class"]]) for cls in sorted(classes)}
    out["requests"] = len(requests)
    out["completed"] = min(r["completed"] for r in runs.values())
    out["by_poll_phase"] = [{"poll_phase_s": phase, **{k: r[k] for k in ("goodput_rps", "ttft_p50_s", "tpot_p50_s")}}
                            for phase, r in runs.items()]
    return out


def simulated_served(requests, s: ValidateSettings, poll_phase_s: float | None = None) -> list:
    """One simulated run; the gateway's first poll at `poll_phase_s` (default: the middle of poll_phases())."""
    from loadtests.sim.fleet.cost_models import InSituCostModel, LinearCostModel
    from loadtests.sim.fleet.cpu_fit import fit_path
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.gateway_path import GatewayPath
    from loadtests.sim.fleet.simulator import FleetSim, SimSettings, StackSpec

    fit_file = fit_path()  # one file for every figure of the run
    fit = json.loads(fit_file.read_text())
    # the steps as the running stack runs them, where fleet-calibrate --in-situ measured that; else the runner alone
    in_situ = InSituCostModel.from_json(fit_file)
    slowdown = fit["in_situ"]["neighbour_slowdown"] if in_situ else fit.get("neighbour_slowdown", 0.0)
    path = GatewayPath.from_json(stack_poll_interval_s(), fit_file)
    phase = poll_phases()[POLL_PHASES // 2] if poll_phase_s is None else poll_phase_s
    settings = SimSettings(chain_sessions=False, gateway=dataclasses.replace(path, poll_phase_s=phase),
                           neighbour_slowdown=slowdown)
    sim = FleetSim(StackSpec("validate", s.kinds, "duet"), requests, in_situ or LinearCostModel.from_json(fit_file),
                   EngineProfile.for_cost_model("cpu"), settings)
    return sim.run()


def cpu_stack(kinds: tuple[str, ...], trace_dir: Path | None = None, model: str | None = None,
              router: str = "duet"):
    """The local stack --validate runs (a context manager yielding (stack, model dir)): `kinds` on the `cpu`
    profile's limits, at the cpu fit's dtype and threads, and `duet bench compare`'s SmolLM2-shaped checkpoint (or
    `model`), each worker on its own core (loadtests/stack/pinning.pinned_stack), behind `router`, with its step
    trace in `trace_dir` when given."""
    from loadtests.experiments.compare import gateway_policy
    from loadtests.stack.pinning import pinned_stack

    checkpoint, limits = stack_limits(model)
    return pinned_stack(checkpoint, kinds, limits, trace_dir,
                        gateway_extra=gateway_policy("duet" if router == "duet" else "sglang_cache_aware"))


def stack_limits(model: str | None = None):
    """(checkpoint, EngineLimits) of cpu_stack's workers: the `cpu` profile's KV and batch limits."""
    from duet.launcher import EngineLimits
    from duet.model_dir import read_model_dir
    from loadtests.sim.fleet.cpu_fit import fit_path, stack_dtype, stack_threads
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.stack.serving import preset_checkpoint

    profile = EngineProfile.for_cost_model("cpu")
    checkpoint = Path(model).expanduser().resolve() if model else preset_checkpoint("smollm2")
    # the workers compute in the dtype and thread count the cpu fit timed (cpu_fit.stack_dtype: a fit that does not
    # record its dtype timed the checkpoint's own): at another dtype the steps are not the ones the fit describes
    fit = json.loads(fit_path().read_text())
    limits = EngineLimits(kv_cache_tokens=profile.kv_cache_tokens, max_num_seqs=profile.max_num_seqs,
                          max_num_batched_tokens=profile.max_num_batched_tokens, page_size=profile.page_size,
                          dtype=stack_dtype(fit, read_model_dir(str(checkpoint)).config.dtype),
                          torch_threads=stack_threads(fit))
    return checkpoint, limits


def local(requests, s: ValidateSettings, progress=None, trace_dir: Path | None = None) -> tuple[dict, dict, list]:
    """The local run's figures, its workers' pids -> worker ids (to name their step traces) and the client's
    records."""
    from duet.tokenizer import Tokenizer
    from loadtests.load.client import arun_benchmark
    from loadtests.load.workloads import BenchRequest
    from loadtests.sim.fleet.engine import EngineProfile

    profile = EngineProfile.for_cost_model("cpu")
    bench = [BenchRequest(r.request_id, r.traffic_class, tuple(r.prompt(profile.max_model_len)), r.max_tokens,
                          arrival_s=r.arrival_s, session_id=r.session) for r in requests]
    with cpu_stack(s.kinds, trace_dir, s.model, s.router) as (stack, model_dir):
        if progress:
            progress(f"local stack up ({len(s.kinds)} workers pinned to cores); sending {len(bench)} requests")
        records = asyncio.run(arun_benchmark(stack.url, model_dir.name, bench,
                                             encode=Tokenizer.from_dir(model_dir).encode, progress=False))
        pids = {stack.supervisor.pid(worker_id): worker_id for worker_id, _, _ in stack.slots}
    by_id = {r.request_id: r for r in requests}
    served = []
    for rec in records:
        ok = rec.ok and rec.e2e_s is not None
        tpot = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1) if ok and rec.output_tokens > 1 else 0.0
        served.append(_LocalServed(by_id[rec.request_id], rec.ttft_s or 0.0, tpot, rec.output_tokens, ok,
                                    rec.prompt_tokens))
    return _figures(served, requests[-1].arrival_s - requests[0].arrival_s, s.slos), pids, records


def per_request_rows(sim_served, records) -> list[dict]:
    """Both sides of each request, by id (`--per-request`): to tell a constant offset from a gap that grows
    with the prompt or with the queue."""
    local_by_id = {r.request_id: r for r in records}
    rows = []
    for x in sim_served:
        rec = local_by_id.get(x.req.request_id)
        rows.append({"request_id": x.req.request_id, "class": x.req.traffic_class, "sent_s": round(x.sent_s, 4),
                     "prompt_tokens": x.prompt_tokens,
                     "sim": {"engine": x.kind, "reason": x.reason, "cached_tokens": x.cached_tokens,
                             "ttft_s": round(x.ttft_s, 4), "tpot_s": round(x.tpot_s, 4), "tokens": x.tokens},
                     "local": None if rec is None else {
                         "engine": rec.engine, "reason": rec.route_reason, "cached_tokens": rec.cached_tokens,
                         "ttft_s": rec.ttft_s, "tpot_s": rec.tpot_s, "tokens": rec.output_tokens,
                         "text_chunks": len(rec.chunk_times_s), "error": rec.error}})
    return rows


def validate(s: ValidateSettings = ValidateSettings(), progress=None, per_request: Path | None = None) -> dict:
    """The validation's figures; with `per_request`, both sides of every request as JSON lines there."""
    from loadtests.sim.fleet.cpu_fit import fit_report
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.step_check import step_cost_check
    from loadtests.sim.fleet.workload import MIXES, build

    requests = build(MIXES["mixed"], s.window_s, s.rate, EngineProfile.for_cost_model("cpu").max_model_len,
                     max_output_tokens=s.max_output_tokens, max_prompt_tokens=s.max_prompt_tokens)
    phases = poll_phases()
    by_phase = {phase: simulated_served(requests, s, phase) for phase in phases}
    sim = simulated(requests, s, by_phase)
    sim_served = by_phase[phases[POLL_PHASES // 2]]  # --per-request's phase
    if progress:
        progress(f"simulated: {sim}")
    with tempfile.TemporaryDirectory(prefix="duet-validate-trace-") as tmp:
        real, pids, records = local(requests, s, progress, Path(tmp))
        steps = step_cost_check(Path(tmp), pids)  # loadtests/sim/fleet/step_check.py
    if per_request is not None:
        Path(per_request).write_text("".join(json.dumps(row) + "\n" for row in per_request_rows(sim_served, records)))
    return {"workload": {"mix": "mixed", "window_s": s.window_s, "rate": s.rate, "requests": len(requests),
                         "max_prompt_tokens": s.max_prompt_tokens, "max_output_tokens": s.max_output_tokens,
                         "workers": list(s.kinds)},
            "local": real, "simulated": sim,
            "goodput_error": _error(sim["goodput_rps"], real["goodput_rps"]),
            "ttft_p50_error": _error(sim["ttft_p50_s"], real["ttft_p50_s"]),
            "tpot_p50_error": _error(sim["tpot_p50_s"], real["tpot_p50_s"]),
            "local_steps_vs_cpu_model": steps,
            # the fit the simulated side used, and whether it is this machine's (else the errors compare two machines)
            "cost_fit": fit_report()}


def format_table(result: dict) -> str:
    from loadtests.sim.fleet.cpu_fit import format_warning

    lines = [*format_warning(result["cost_fit"]), "| figure | local | simulated | relative error |", "|---|---|---|---|"]
    for key, err in (("goodput_rps", "goodput_error"), ("ttft_p50_s", "ttft_p50_error"),
                     ("tpot_p50_s", "tpot_p50_error")):
        lines.append(f"| {key} | {result['local'][key]} | {result['simulated'][key]} | {result[err]} |")
    return "\n".join(lines)
