"""`duet bench simulate-routing`: its flags, and the run (loadtests/sim/routing/simulate.py) imported lazily."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from loadtests.sim.routing.simulate import ServiceModel, format_table, run
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
