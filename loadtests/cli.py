"""`duet bench ...`: the load-test commands. duet/cli.py hands `duet bench` its arguments
here. Each subcommand is one subparser whose handler imports its module lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _add_simulate_routing(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate-routing",
        help="replay a trace through routing policies over simulated workers",
        description="Replays a Mooncake trace through round robin, least load, consistent hash, an "
        "SGLang-style cache-aware policy and Duet's own routing (gateway.routing.policy.route), over "
        "simulated workers with LRU block caches; reports block hit rates and load balance.",
    )
    p.add_argument("--trace", default="mooncake", help="a shipped trace (mooncake, azure_code, azure_conv) or a "
                   "Mooncake JSONL, Azure CSV or OpenAI request log file (loadtests/traces/formats.py)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--cache-blocks", type=int, default=2048, help="per-worker cache capacity in trace blocks (512 tokens)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies the trace's arrival times: 0.5 replays twice as fast (twice the load)")
    p.add_argument("--policies", default="round_robin,least_load,consistent_hash,sglang_cache_aware,duet",
                   help="comma-separated policy names")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N records")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0, help="simulated prefill speed per worker")
    p.add_argument("--decode-ms-per-token", type=float, default=20.0, help="simulated decode time per token")
    p.add_argument("--routing-config", default=None, help="JSON routing config for the duet policy (default: built-in)")
    p.add_argument("--no-sessions", action="store_true",
                   help="duet policy: clients send no session key (no affinity; the prefix index alone)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_run_simulate_routing)


def _run_simulate_routing(args: argparse.Namespace) -> int:
    from loadtests.experiments.simulate_routing import ServiceModel, format_table, run
    from loadtests.traces import shipped

    config = None
    if args.routing_config:
        from gateway.control.state.codec import config_from_json

        with open(args.routing_config) as f:
            config = config_from_json(f.read())
    service = ServiceModel(prefill_tokens_per_s=args.prefill_tokens_per_s,
                           decode_s_per_token=args.decode_ms_per_token / 1000.0)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    result = run(str(shipped.resolve(args.trace)), args.workers, args.cache_blocks, args.time_scale, policies, args.limit, service,
                 config, sessions=not args.no_sessions)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _run_advise_fleet(args: argparse.Namespace) -> int:
    from loadtests.fleet import advise_fleet
    from loadtests.fleet.bench import FleetSettings
    from loadtests.fleet.cost_models import COST_MODELS
    from loadtests.fleet.report import parse_slos
    from loadtests.fleet.workload import parse_mix

    if args.cost_model not in COST_MODELS:
        raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, got {args.cost_model!r}")
    s = FleetSettings(cost_model=args.cost_model, workers=args.workers or 8, mix=parse_mix(args.trace),
                      window_s=args.window_s, rate=args.rate, slos=parse_slos(args.class_slo, args.cost_model, "--class-slo"))
    result = advise_fleet.advise(s, args.worker_hour_usd, progress=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else advise_fleet.format_markdown(result))
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="the headline experiment: all-paged vs all-prefix vs duet (fixed and planned) on one mixed workload",
        description="Starts four stacks of the same size on the same checkpoint, one after the other: all "
        "engine_paged and all engine_prefix behind cache-aware routing, half of each behind Duet's routing, and "
        "Duet with the pool planner switching kinds; sends each the same mixed workload (multi-turn chats, agent "
        "loops, unrelated long documents; Poisson arrivals) at three rates with repeats, and reports goodput and "
        "TTFT per traffic class (loadtests/experiments/compare.py). With no options: the headline run.",
    )
    p.add_argument("--model", default=None,
                   help="model directory (default: a random checkpoint of SmolLM2-135M's shape, made once)")
    p.add_argument("--workers", type=int, default=None, help="workers per stack (default 4; duet: half of each kind)")
    p.add_argument("--quick", action="store_true", help="a small check of the machinery (2 workers, light rate)")
    p.add_argument("--num-requests", type=int, default=None, help="per run (default: rate x 120 s)")
    p.add_argument("--rates", default=None,
                   help="comma-separated: light, medium, heavy or numbers (arrivals/s: conversations + documents)")
    p.add_argument("--repeats", type=int, default=None, help="runs per rate (default: 3 at medium, 1 at the others)")
    p.add_argument("--mix", default=None, help="class shares, e.g. multi_turn=2,agent=1,long_doc=1 (default 1:1:1)")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT bound of goodput (default 5000)")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="bound on a request's mean inter-token latency (default 250)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="per worker, every stack alike (default 4096)")
    p.add_argument("--configs", default=None, help="comma-separated subset of all_paged,all_prefix,duet_fixed,duet_planner")
    p.add_argument("--pin-cores", action="store_true",
                   help="worker i on core i (default 2 workers: one per core here) and per-class SLOs")
    p.add_argument("--class-slo", default=None,
                   help="per-class TTFT bounds in ms, e.g. long_doc=8000,multi_turn=1500 (implies per-class SLOs)")
    p.add_argument("--log-dir", default=None, help="keep the stacks' logs here (default: temp dirs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_run_compare)


def compare_settings(args: argparse.Namespace):
    """The Settings the parsed flags describe (tests check this without starting a stack)."""
    from dataclasses import replace

    from loadtests.class_slo import ClassSlo, parse_class_slos
    from loadtests.experiments import compare

    s = compare.QUICK if args.quick else compare.Settings()
    if args.pin_cores:
        s = replace(s, pin_cores=True, workers=2, class_slo=ClassSlo())
    given = {k: getattr(args, k) for k in ("model", "workers", "num_requests", "repeats", "max_prompt_tokens",
                                            "max_tokens", "seed")}
    given.update(ttft_slo_ms=args.slo_ttft_ms, itl_slo_ms=args.slo_itl_ms)
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    if args.class_slo:
        s = replace(s, class_slo=parse_class_slos(args.class_slo, s.class_slo))
    if args.rates:
        s = replace(s, rates=tuple(r.strip() for r in args.rates.split(",") if r.strip()))
    if args.mix:
        s = replace(s, shares=compare.parse_mix(args.mix))
    if args.kv_cache_tokens is not None:
        s = replace(s, limits=replace(s.limits, kv_cache_tokens=args.kv_cache_tokens))
    if args.configs:
        s = replace(s, configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()))
    return s.validate()


def _run_compare(args: argparse.Namespace) -> int:
    from loadtests.experiments import compare
    from loadtests.experiments.compare_report import format_table

    s = compare_settings(args)
    from loadtests.experiments.stack import StackError

    try:
        result = compare.run(s, args.log_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except StackError as e:  # a worker or the gateway did not come up: its log says why
        print(f"duet bench compare: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _add_chaos(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos",
        help="fault drill: kill/freeze workers, restart Redis, kill a gateway, under load and fuzzed input",
        description="Starts a local stack (engine_paged + engine_prefix on the tiny model, two gateways sharing a "
        "private Redis, all supervised), runs mixed traffic and hostile bodies while it kills a worker (-9), "
        "freezes one longer than the stall timeout, restarts Redis and kills a gateway; prints requests, ok, "
        "clean_errors, lost, hung, leaked_pages, rss_growth_mb and recovery_s per fault.",
    )
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--clients", type=int, default=None, help="concurrent request loops")
    p.add_argument("--soak", type=float, default=0.0, metavar="MINUTES",
                   help="repeat the fault cycle for this long (default: one cycle)")
    p.add_argument("--stall-s", type=float, default=None, help="the gateways' stall timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="keep the stack's logs here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.set_defaults(func=_run_chaos)


def _run_chaos(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from loadtests.experiments.chaos import ChaosSettings, run
    from loadtests.experiments.stack import StackError

    s = replace(ChaosSettings(), soak_minutes=args.soak, seed=args.seed,
                **{k: v for k, v in (("clients", args.clients), ("stall_s", args.stall_s)) if v is not None})
    try:
        result = run(s, args.model, args.log_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except StackError as e:
        print(f"duet bench chaos: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=None if args.json else 2))
    clean = result["lost"] == 0 and result["hung"] == 0 and not any(result["leaked_pages"].values())
    return 0 if clean else 1


def _add_advise(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise", help="paged, prefix or both? replay your own trace against each deployment",
        description="Replays a trace (Mooncake JSONL, Azure CSV or an OpenAI request log of JSON lines) against "
        "all-paged, all-prefix and Duet (every split of the workers), in the routing simulator with --simulate "
        "or for real on this machine, and recommends one, as markdown and a PNG chart (loadtests/experiments/advise.py).",
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
    p.set_defaults(func=_run_advise)


def _run_advise(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadtests.experiments import advise
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet bench", description="Duet load tests and simulations")
    parser.add_argument("--trace-dir", default=None, help="read the named traces (mooncake, azure_code, azure_conv) "
                        "from this folder instead of the shipped ones (the same as DUET_TRACE_DIR)")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    _add_simulate_routing(sub)
    _add_compare(sub)
    from loadtests.experiments.classes_cli import (
        add_parser as add_classes,  # argparse only; the run imports lazily
    )

    add_classes(sub)
    _add_chaos(sub)
    _add_advise(sub)
    from loadtests.experiments.bench_run import add_parser as add_run  # argparse only; the run imports lazily

    add_run(sub)
    from loadtests.experiments.peer import add_parser as add_peer  # argparse only; the run imports lazily

    add_peer(sub)
    from loadtests.experiments.baseline import (
        add_parser as add_baseline,  # argparse only; the runs import lazily
    )
    from loadtests.experiments.engine_diff import add_parser as add_diff

    add_baseline(sub)
    add_diff(sub)
    from loadtests.fleet.cli import add_parser as add_fleet  # argparse only; the runs import lazily

    add_fleet(sub)
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
