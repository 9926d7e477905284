"""`duet bench advise`: its flags, checked per mode, and the run of each mode (imported lazily).

`--from-gateway URL` replays the gateway's own traffic capture (gateway/control/capture.py, fetched as `duet capture
export` does) in the fleet simulator; a capture file given as `--trace FILE --fleet` is replayed the same way. When
external backends (vLLM, SGLang) served the captured traffic, the step costs are calibrated from their measured rates
(the gateway's GET /admin/workers) and the SLOs are the gateway's own table for the model (its routing config's
`slo_profile`): loadtests/advise/calibrated.py. `--cost-from-gateway URL` does that for any --trace, and
`--backend-rates ENGINE:prefill=N,decode=M` gives the rates without a gateway (or fills in one it lacks).

Three modes, one rule (loadtests/advise/rule.py) and the same outputs (loadtests/advise/report.py: markdown, or
--json; with --out, advice.md, advice.json and advice.png):

    --simulate   the routing simulation (loadtests/advise/routing_sim.py)
    --fleet      the fleet simulator (loadtests/advise/fleet.py)
    (neither)    a local replay on this machine (loadtests/advise/local.py)

A flag of another mode is refused with one line naming the modes it applies to, not silently ignored.
"""

from __future__ import annotations

import argparse
import json
import sys

from duet.traffic_classes import CPU, bound_of

SIMULATE, LOCAL, FLEET = "--simulate", "the local replay", "--fleet"
# flag -> (argparse dest, the modes it applies to, its default there); every other flag applies to every mode
MODE_FLAGS = {
    "--cache-blocks": ("cache_blocks", (SIMULATE, LOCAL), 2048),
    "--time-scale": ("time_scale", (SIMULATE, LOCAL), 1.0),
    # a replayed conversation is the table's session class, on the bench machine's profile
    "--slo-ttft-s": ("slo_ttft_s", (SIMULATE, LOCAL), bound_of("session", CPU).ttft_ms / 1000),
    "--limit": ("limit", (SIMULATE, LOCAL), None),
    "--model": ("model", (LOCAL,), None),
    "--cost-model": ("cost_model", (FLEET,), "h200"),
    "--cost-file": ("cost_file", (FLEET,), None),
    "--rate": ("rate", (FLEET,), 1.0),
    "--window-s": ("window_s", (FLEET,), 300.0),
    "--class-slo": ("class_slo", (FLEET,), None),
    "--worker-hour-usd": ("worker_hour_usd", (FLEET,), None),
}
DEFAULT_WORKERS = {SIMULATE: 8, LOCAL: 4, FLEET: 8}
DEFAULT_TRACE = {SIMULATE: "mooncake", LOCAL: "mooncake", FLEET: "mixed"}
VALIDATE_WORKERS = 2  # --validate: one engine worker per core of the local stack (loadtests/stack/pinning.py)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise", help="paged, prefix or both? replay your own trace against each deployment",
        description="Replays a trace (Mooncake JSONL, Azure CSV or an OpenAI request log of JSON lines) against "
        "all-paged, all-prefix, one kind behind Duet's router and Duet's splits: in the routing simulator "
        "(--simulate), in the fleet simulator (--fleet) or for real on this machine; recommends one by one rule "
        "(loadtests/advise/rule.py), as markdown, JSON and a PNG chart.",
    )
    p.add_argument("--trace", default=None, help="a shipped trace (mooncake, azure_code, azure_conv) or a Mooncake "
                   "JSONL, Azure CSV or OpenAI request log file (default: mooncake; --fleet: mixed)")
    p.add_argument("--simulate", action="store_true", help="the routing simulator (fast, any trace size)")
    p.add_argument("--fleet", action="store_true", help="the fleet simulator (real schedulers and router, a cost "
                   "model): per option goodput, TTFT/TPOT, $ per million tokens, at half and double the traffic too "
                   "(--trace also takes mixed, chat, documents)")
    p.add_argument("--workers", type=int, default=None, help="workers per deployment (default 8 simulated, 4 local)")
    p.add_argument("--out", default=None, help="write advice.md, advice.json and advice.png here (every mode)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the markdown")
    p.add_argument("--cache-blocks", type=int, default=None,
                   help="--simulate and local: simulated per-worker cache, 512-token blocks (default 2048)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="--simulate and local: multiplies arrival times (0.5: twice the load; default 1)")
    p.add_argument("--slo-ttft-s", type=float, default=None,
                   help="--simulate and local: TTFT bound of goodput, seconds (default 2: the session "
                   "class on the cpu profile of duet/traffic_classes.py)")
    p.add_argument("--limit", type=int, default=None,
                   help="--simulate and local: replay only the first N records (local default 200)")
    p.add_argument("--model", default=None, help="local: model directory (default: the bench checkpoint)")
    p.add_argument("--cost-model", default=None, help="--fleet: h200 (the default), h200-70b or cpu (--from-gateway "
                   "on traffic vLLM or SGLang served: default calibrated from their measured rates)")
    p.add_argument("--cost-file", default=None, metavar="FILE", help="--fleet with --cost-model cpu, and --validate: "
                   "the cpu fit to read (default: this machine's own from duet bench fleet-calibrate, else the "
                   "repository's loadtests/sim/fleet/cpu_cost.json); the answer says whether it describes this "
                   "machine and dtype (loadtests/sim/fleet/cpu_fit.py)")
    p.add_argument("--rate", type=float, default=None, help="--fleet: arrival-rate multiplier (default 1)")
    p.add_argument("--window-s", type=float, default=None, help="--fleet: trace seconds replayed (default 300)")
    p.add_argument("--class-slo", default=None, help="--fleet: per-class SLOs in ms, e.g. chat.ttft=3000,"
                   "document.ttft=6s (defaults: duet/traffic_classes.py, the cost model's profile)")
    p.add_argument("--worker-hour-usd", type=float, default=None, help="--fleet: price of one worker-hour")
    p.add_argument("--from-gateway", default=None, metavar="URL",
                   help="replay a running gateway's traffic capture (GET /admin/capture; implies --fleet): the "
                   "answer adds the canary config that would start the move; traffic that vLLM or SGLang backends "
                   "served is simulated on step costs calibrated from their measured rates")
    p.add_argument("--admin-key", default=None, help="--from-gateway: the gateway's admin key (or DUET_ADMIN_KEY)")
    p.add_argument("--cost-from-gateway", default=None, metavar="URL",
                   help="(implies --fleet) step costs calibrated from the measured rates of a running gateway's "
                   "external vLLM / SGLang backends (GET /admin/workers), SLOs from its routing config; with "
                   "--from-gateway this happens by itself when such backends served the capture")
    p.add_argument("--backend-rates", action="append", default=None, metavar="ENGINE:prefill=N,decode=M",
                   help="(implies --fleet) step costs calibrated from these rates, tokens/s while busy, for engine "
                   "vllm (simulated as engine_paged with vLLM's settings) or sglang (engine_prefix's radix "
                   "scheduler); also step_ms=S (a fixed cost a step) and kv_tokens=K (KV capacity a worker); "
                   "repeat per engine; with a gateway it fills in or replaces what the gateway measured (SGLang "
                   "has no decode rate there)")
    p.add_argument("--validate", action="store_true",
                   help="with --trace FILE or --from-gateway (implies --fleet, on the cpu cost model, default 2 "
                   "workers): then run the recommended deployment on this machine on the same requests and print "
                   "advise's predicted goodput and TTFT p50 beside the measured ones (loadtests/advise/validate.py; "
                   "--model: local checkpoint, default the SmolLM2-shaped one the cpu model was fitted on)")
    p.add_argument("--per-request", default=None, metavar="PATH", help="--validate: write both sides of every request "
                   "(worker, route reason, cached tokens, TTFT, TPOT; simulated and measured) to PATH as JSON lines")
    p.set_defaults(func=_run)


def mode_of(args: argparse.Namespace) -> str:
    """The mode the flags ask for; every mode flag given checked against it, then the mode's defaults filled in."""
    if args.simulate and args.fleet:
        raise ValueError("give --simulate or --fleet, not both")
    calibrating = getattr(args, "cost_from_gateway", None) or getattr(args, "backend_rates", None)
    if args.from_gateway:
        if args.simulate or args.trace:
            raise ValueError("--from-gateway replays the gateway's capture in the fleet simulator: give neither "
                             "--simulate nor --trace with it")
        if getattr(args, "cost_from_gateway", None):
            raise ValueError("--from-gateway reads the gateway's backend rates itself: leave out --cost-from-gateway")
        args.fleet = True
    elif args.admin_key and not getattr(args, "cost_from_gateway", None):
        raise ValueError("--admin-key goes with --from-gateway or --cost-from-gateway")
    if calibrating:
        if args.simulate:
            raise ValueError("--cost-from-gateway and --backend-rates calibrate the fleet simulator's step costs: "
                             "give them without --simulate")
        if args.validate:
            raise ValueError("--validate predicts with the cpu cost model fitted on this machine: give it without "
                             "--cost-from-gateway or --backend-rates")
        if args.cost_model is not None:
            raise ValueError(f"--cost-model {args.cost_model} and measured backend rates are two cost models: give "
                             f"one (the rates calibrate one: loadtests/advise/calibrated.py)")
        args.fleet = True
    if getattr(args, "per_request", None) and not args.validate:
        raise ValueError("--per-request goes with --validate (both sides of each request)")
    if args.validate:
        _validate_flags(args)
    mode = SIMULATE if args.simulate else FLEET if args.fleet else LOCAL
    for flag, (dest, modes, default) in MODE_FLAGS.items():
        if args.validate and dest == "model":
            continue  # the validation's local checkpoint
        if mode not in modes and getattr(args, dest) is not None:
            raise ValueError(f"{flag} does not apply to {mode}; it is for {' and '.join(modes)}")
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if getattr(args, "cost_file", None) is not None and args.cost_model != "cpu":
        raise ValueError(f"--cost-file is the cpu cost model's fit: give it with --cost-model cpu or --validate, not "
                         f"--cost-model {args.cost_model}")
    args.workers = args.workers or (VALIDATE_WORKERS if args.validate else DEFAULT_WORKERS[mode])
    args.trace = args.trace or DEFAULT_TRACE[mode]
    return mode


def _validate_flags(args: argparse.Namespace) -> None:
    """--validate: advise in the fleet simulator on this machine's cost model, for a trace file or a capture."""
    import os

    if args.simulate:
        raise ValueError("--validate checks the fleet simulator's prediction: give it without --simulate")
    if not args.from_gateway and not (args.trace and os.path.isfile(args.trace)):
        raise ValueError("--validate replays a trace file (--trace FILE) or a gateway's capture (--from-gateway URL)")
    if args.cost_model not in (None, "cpu"):
        raise ValueError(f"--validate runs the recommendation on this machine, so advise predicts with the cpu cost "
                         f"model (fitted here), not {args.cost_model!r}")
    args.fleet, args.cost_model = True, "cpu"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _capture_file(args: argparse.Namespace) -> str:
    """--from-gateway: the gateway's capture, written into --out (or a temporary folder) as capture.jsonl."""
    import os
    import tempfile
    from pathlib import Path

    from duet.capture_export import fetch_capture

    text = fetch_capture(args.from_gateway, args.admin_key or os.environ.get("DUET_ADMIN_KEY"))
    if not text.strip():
        raise ValueError(f"the gateway at {args.from_gateway} has captured no request yet: send traffic first")
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="duet-advise-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "capture.jsonl"
    path.write_text(text)
    _progress(f"{sum(1 for line in text.splitlines() if line.strip())} captured requests -> {path}")
    return str(path)


def _calibration(args: argparse.Namespace, cost_model_given: bool):
    """The step costs, profile and SLO table calibrated from backend rates (loadtests/advise/calibrated.py), or None
    where advise keeps its named cost model: no rates given or asked for, or --from-gateway on traffic that Duet's
    own engines served (or with --cost-model / --validate, which name the model)."""
    import os

    from loadtests.advise import calibrated
    from loadtests.sim.fleet.workload import parse_mix

    given = calibrated.parse_backend_rates(getattr(args, "backend_rates", None))
    gateway = args.from_gateway or getattr(args, "cost_from_gateway", None)
    if not given and (not gateway or cost_model_given or args.validate):
        return None
    mix = parse_mix(args.trace)
    if gateway:
        cal = calibrated.from_gateway(gateway, args.admin_key or os.environ.get("DUET_ADMIN_KEY"), mix, given,
                                      args.class_slo, required=not args.from_gateway)
        if cal is None:
            return None  # Duet's own engines served the capture: the named cost model, as ever
    else:
        cal = calibrated.build_calibration(given, calibrated.GPU, args.class_slo)
    for kind, r in cal.rates.items():
        _progress(f"{kind}: {r.source()}")
    return cal


def _fleet_settings(args: argparse.Namespace):
    from loadtests.sim.fleet.bench import CALIBRATED, FleetSettings
    from loadtests.sim.fleet.cost_models import COST_MODELS
    from loadtests.sim.fleet.report import parse_slos
    from loadtests.sim.fleet.workload import parse_mix

    cal = getattr(args, "calibration", None)
    if cal is not None:
        return FleetSettings(cost_model=CALIBRATED, workers=args.workers, mix=parse_mix(args.trace),
                             window_s=args.window_s, rate=args.rate, slos=cal.slos, calibration=cal)
    if args.cost_model not in COST_MODELS:
        raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, got {args.cost_model!r}")
    # --validate's local replay sends every request at its own arrival time (sim/fleet/validate.local: an open-loop
    # client), so the prediction it checks must too: chained turns would be sent after the previous answer, the
    # queueing the replay measures left out of the prediction
    return FleetSettings(cost_model=args.cost_model, workers=args.workers, mix=parse_mix(args.trace),
                         window_s=args.window_s, rate=args.rate,
                         slos=parse_slos(args.class_slo, args.cost_model, "--class-slo"),
                         chain_sessions=not getattr(args, "validate", False))


def _fleet(args: argparse.Namespace) -> dict:
    from loadtests.advise import fleet
    from loadtests.sim.fleet.cpu_fit import fit_report, use_cost_file

    use_cost_file(getattr(args, "cost_file", None))
    s = _fleet_settings(args)
    result = fleet.advise(s, args.worker_hour_usd, progress=_progress)
    if s.cost_model == "cpu":
        # which machine, dtype and threads the prediction describes, and whether that is this one
        result["cost_fit"] = fit_report()
        for line in result["cost_fit"]["differences"]:
            _progress(f"warning: {line}")
    if args.validate:
        from loadtests.advise.validate import validate_advice

        result["validation"] = validate_advice(result, s, args.model, progress=_progress,
                                               per_request=getattr(args, "per_request", None))
    return result


def _trace(args: argparse.Namespace, mode: str) -> dict:
    from loadtests.advise.routing_sim import AdviseSettings, advise_simulated
    from loadtests.traces import shipped

    trace = str(shipped.resolve(args.trace))
    s = AdviseSettings(workers=args.workers, cache_blocks=args.cache_blocks, time_scale=args.time_scale,
                       slo_ttft_s=args.slo_ttft_s, limit=args.limit)
    if mode == SIMULATE:
        return advise_simulated(trace, s)
    from loadtests.advise.local import advise_local

    return advise_local(trace, s, args.model, progress=_progress)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadtests.advise.report import format_markdown, write_out

    cost_model_given = args.cost_model is not None
    mode = mode_of(args)
    if args.from_gateway:
        args.trace = _capture_file(args)
    if mode == FLEET:
        args.calibration = _calibration(args, cost_model_given)
    result = _fleet(args) if mode == FLEET else _trace(args, mode)
    text = format_markdown(result)
    if args.out:
        write_out(result, text, Path(args.out))
    print(json.dumps(result, indent=2) if args.json else text)
    return 0
