"""`duet bench advise`: its flags and the run of each mode, imported lazily."""

from __future__ import annotations

import argparse
import json
import sys


def _run_advise_fleet(args: argparse.Namespace) -> int:
    from loadtests.advise import fleet as advise_fleet
    from loadtests.sim.fleet.bench import FleetSettings
    from loadtests.sim.fleet.cost_models import COST_MODELS
    from loadtests.sim.fleet.report import parse_slos
    from loadtests.sim.fleet.workload import parse_mix

    if args.cost_model not in COST_MODELS:
        raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, got {args.cost_model!r}")
    s = FleetSettings(cost_model=args.cost_model, workers=args.workers or 8, mix=parse_mix(args.trace),
                      window_s=args.window_s, rate=args.rate, slos=parse_slos(args.class_slo, args.cost_model, "--class-slo"))
    result = advise_fleet.advise(s, args.worker_hour_usd, progress=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else advise_fleet.format_markdown(result))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise", help="paged, prefix or both? replay your own trace against each deployment",
        description="Replays a trace (Mooncake JSONL, Azure CSV or an OpenAI request log of JSON lines) against "
        "all-paged, all-prefix and Duet (every split of the workers), in the routing simulator with --simulate "
        "or for real on this machine, and recommends one, as markdown and a PNG chart (loadtests/advise/routing_sim.py).",
    )
    p.add_argument("--trace", default=None, help="a shipped trace (mooncake, azure_code, azure_conv) or a Mooncake "
                   "JSONL, Azure CSV or OpenAI request log file (default: mooncake; --fleet: mixed)")
    p.add_argument("--simulate", action="store_true", help="the routing simulator (fast, any trace size)")
    p.add_argument("--workers", type=int, default=None, help="workers per deployment (default 8 simulated, 4 local)")
    p.add_argument("--cache-blocks", type=int, default=2048, help="simulated per-worker cache, 512-token blocks")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies arrival times (0.5: twice the load)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT bound of goodput, seconds")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N records (local default 200)")
    p.add_argument("--model", default=None, help="local replay: model directory (default: the bench checkpoint)")
    p.add_argument("--out", default=None, help="write advice.md, advice.json and advice.png here")
    p.add_argument("--fleet", action="store_true", help="the fleet simulator (real schedulers and router, a cost "
                   "model): per option goodput, TTFT/TPOT, $ per million tokens, at half and double the traffic too "
                   "(--trace also takes mixed, chat, documents)")
    p.add_argument("--cost-model", default="h200", help="--fleet: h200, h200-70b or cpu")
    p.add_argument("--rate", type=float, default=1.0, help="--fleet: arrival-rate multiplier")
    p.add_argument("--window-s", type=float, default=300.0, help="--fleet: trace seconds replayed")
    p.add_argument("--class-slo", default=None, help="--fleet: per-class SLOs in ms, e.g. chat.ttft=3000,document.ttft=6s")
    p.add_argument("--worker-hour-usd", type=float, default=None, help="--fleet: price of one worker-hour")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the markdown")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadtests.advise import routing_sim as advise
    from loadtests.traces import shipped

    if args.fleet:
        args.trace = args.trace or "mixed"
        return _run_advise_fleet(args)
    args.trace = str(shipped.resolve(args.trace or "mooncake"))
    workers = args.workers or (8 if args.simulate else 4)
    s = advise.AdviseSettings(workers=workers, cache_blocks=args.cache_blocks, time_scale=args.time_scale,
                              slo_ttft_s=args.slo_ttft_s, limit=args.limit)
    if args.simulate:
        result = advise.advise_simulated(args.trace, s)
    else:
        result = advise.advise_local(args.trace, s, args.model,
                                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    text = advise.format_markdown(result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "advice.md").write_text(text)
        (out / "advice.json").write_text(json.dumps(result, indent=2))
        advise.write_chart(result, out / "advice.png")
    print(json.dumps(result, indent=2) if args.json else text)
    return 0
