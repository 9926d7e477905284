"""`duet bench ...`: the load-test commands. duet/cli.py hands `duet bench` its arguments
here. Each subcommand is one subparser whose handler imports its module lazily."""

from __future__ import annotations

import argparse
import json
import sys


def _add_simulate_routing(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate-routing",
        help="replay a trace through routing policies over simulated workers",
        description="Replays a Mooncake trace through round robin, least load, consistent hash, an "
        "SGLang-style cache-aware policy and Duet's own routing (gateway.routing.route), over "
        "simulated workers with LRU block caches; reports block hit rates and load balance.",
    )
    p.add_argument("--trace", required=True, help="Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids)")
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
    from loadtests.simulate_routing import ServiceModel, format_table, run

    config = None
    if args.routing_config:
        from gateway.state.codec import config_from_json

        with open(args.routing_config) as f:
            config = config_from_json(f.read())
    service = ServiceModel(prefill_tokens_per_s=args.prefill_tokens_per_s,
                           decode_s_per_token=args.decode_ms_per_token / 1000.0)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    result = run(args.trace, args.workers, args.cache_blocks, args.time_scale, policies, args.limit, service,
                 config, sessions=not args.no_sessions)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="the headline experiment: all-paged vs all-prefix vs duet on one mixed workload",
        description="Starts three stacks of the same size on the same checkpoint, one after the other: "
        "every worker engine_paged behind round robin, every worker engine_prefix behind cache-aware routing, "
        "and half of each behind Duet's routing; sends each the same mixed workload (multi-turn chats, agent "
        "loops, unrelated long documents; Poisson arrivals) and reports goodput and TTFT per traffic class.",
    )
    p.add_argument("--model", default=None, help="model directory (default: the bench checkpoint, made once)")
    p.add_argument("--workers", type=int, default=2, help="workers per configuration (duet: half of each kind)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (about 2 minutes on 2 cores)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="conversations + documents started per second")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT bound of goodput (default 4000)")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="bound on a request's mean inter-token latency (default 250)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="per worker, every configuration alike")
    p.add_argument("--configs", default=None, help="comma-separated subset of paged_round_robin,prefix_cache_aware,duet")
    p.add_argument("--log-dir", default=None, help="keep the stacks' logs here (default: temp dirs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from loadtests import compare

    s = compare.QUICK if args.quick else compare.Settings()
    given = {k: getattr(args, k) for k in ("model", "workers", "num_requests", "rate", "max_prompt_tokens",
                                            "max_tokens", "seed")}
    given.update(ttft_slo_ms=args.slo_ttft_ms, itl_slo_ms=args.slo_itl_ms)
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    if args.kv_cache_tokens is not None:
        s = replace(s, limits=replace(s.limits, kv_cache_tokens=args.kv_cache_tokens))
    if args.configs:
        s = replace(s, configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()))
    from loadtests.stack import StackError

    try:
        result = compare.run(s, args.log_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except StackError as e:  # a worker or the gateway did not come up: its log says why
        print(f"duet bench compare: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else compare.format_table(result))
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

    from loadtests.chaos import ChaosSettings, run
    from loadtests.stack import StackError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet bench", description="Duet load tests and simulations")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    _add_simulate_routing(sub)
    _add_compare(sub)
    _add_chaos(sub)
    from loadtests.bench_run import add_parser as add_run  # argparse only; the run imports lazily

    add_run(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input (trace, flags, routing config): one clear line
        print(f"duet bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
