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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet bench", description="Duet load tests and simulations")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    _add_simulate_routing(sub)
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
