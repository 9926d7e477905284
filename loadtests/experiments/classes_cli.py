"""`duet bench classes`: its flags and the Settings they make (loadtests/experiments/classes.py runs it).
argparse only at import: `duet bench` builds every subcommand's parser, the run imports lazily."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "classes", help="each engine kind alone on one pinned core, each traffic class alone and mixed",
        description="One worker of each kind, pinned to one core, serves each traffic class (one-shot documents, "
        "multi-turn chat with Mooncake think times, agent loops, structured output, copy/edit) alone and mixed "
        "at a rate near its measured capacity; reports goodput against per-class SLOs, TTFT and TPOT p50/p99, "
        "hit rate, preemptions and evictions of reused KV pages (loadtests/experiments/classes.py).",
    )
    p.add_argument("--model", default=None, help="model directory (default: the compare bench's SmolLM2-shaped checkpoint)")
    p.add_argument("--quick", action="store_true", help="a small check of the machinery (bench preset, short prompts)")
    p.add_argument("--kinds", default=None,
                   help="comma-separated subset of paged,prefix,vllm (vllm: real vLLM on engine_paged's classes, "
                        "installed on first use; default paged,prefix)")
    p.add_argument("--vllm-config", default=None,
                   help="the vllm side's configuration (loadtests/stack/vllm_server.py; default vllm: its model "
                        "worker on one core, one core reserved for its server)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated subset of long_doc,multi_turn,agent,structured,copy_edit,mixed")
    p.add_argument("--num-requests", type=int, default=None, help="per measured run (default 40)")
    p.add_argument("--calib-requests", type=int, default=None, help="the capacity burst's size (default 12)")
    p.add_argument("--load", type=float, default=None, help="arrival rate as a fraction of measured capacity (0.9)")
    p.add_argument("--rate", type=float, default=None, help="arrivals/s for every run instead of --load")
    p.add_argument("--core", default=None, help="taskset core list of the worker (default 0)")
    p.add_argument("--gateway-cores", default=None, help="taskset core list of the gateway (default 1; 'any': unpinned)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="the worker's KV budget (default 8192)")
    p.add_argument("--think-scale", type=float, default=None, help="multiplies the trace's think times (0.05)")
    p.add_argument("--class-slo", default=None, help="TTFT bounds in ms, e.g. long_doc=20000,multi_turn=1500")
    p.add_argument("--engine-args", action="append", default=[], metavar="KIND=FLAGS",
                   help='more worker flags for a kind, e.g. prefix="--cache-eviction lru", or `vllm serve` flags '
                        'for vllm (repeatable)')
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cache-replay", action="store_true",
                   help="no stacks: replay the mix through the real radix cache under each eviction rule "
                        "(deterministic hit rates; --num-requests, default 400)")
    p.add_argument("--page-size", type=int, default=16, help="--cache-replay: tokens per KV page (default 16)")
    p.add_argument("--log-dir", default=None, help="keep the stacks' logs here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_run_classes)


def _csv(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


def classes_settings(args: argparse.Namespace):
    """The Settings the parsed flags describe (tests check this without starting a stack)."""
    from dataclasses import replace

    from loadtests.experiments import classes
    from loadtests.load.class_slo import parse_class_slos

    s = classes.QUICK if args.quick else classes.Settings()
    given = {"model": args.model, "kinds": _csv(args.kinds), "workloads": _csv(args.workloads),
             "num_requests": args.num_requests, "calib_requests": args.calib_requests, "load": args.load,
             "rate": args.rate, "core": args.core, "think_scale": args.think_scale, "seed": args.seed,
             "vllm_config": args.vllm_config}
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    if args.gateway_cores is not None:
        s = replace(s, gateway_cores=None if args.gateway_cores == "any" else args.gateway_cores)
    if args.kv_cache_tokens is not None:
        s = replace(s, limits=replace(s.limits, kv_cache_tokens=args.kv_cache_tokens))
    if args.class_slo:
        s = replace(s, slo=parse_class_slos(args.class_slo, s.slo))
    from loadtests.stack.serving import kind_flags

    return replace(s, engine_args=kind_flags(args.engine_args, classes.SIDES)).validate()


def _run_classes(args: argparse.Namespace) -> int:
    from loadtests.experiments import classes
    from loadtests.stack.serving import StackError

    s = classes_settings(args)
    if args.cache_replay:
        from loadtests.experiments import cache_replay
        from loadtests.experiments.compare import bench_model_dir
        from loadtests.load.workloads import TokenSource

        if args.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {args.page_size}")
        src = TokenSource.from_model_dir(bench_model_dir(s.model, s.preset))
        result = cache_replay.run(src, args.num_requests or 400, page=args.page_size, seed=s.seed, sizes=s.sizes)
        print(json.dumps(result, indent=2) if args.json else cache_replay.format_table(result))
        return 0
    try:
        result = classes.run(s, args.log_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except StackError as e:
        print(f"duet bench classes: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else classes.format_table(result))
    return 0
