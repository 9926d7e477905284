"""`duet bench run`: one workload against one OpenAI-compatible endpoint, summarized.

    duet bench run --url URL --model DIR --workload NAME [--trace FILE] [--num-requests N]
                   [--rate R | --concurrency C] [--time-scale X] [--slo-ttft-ms MS] [--slo-itl-ms MS]
                   [--out DIR] [--json]

Prints the markdown table (or, with --json, the summary object of loadtests/load/report.py); with --out
also writes summary.json, summary.md, records.jsonl (one line per request) and the PNG plots there.
Exit status 0; 1 when no request succeeded (the first error is printed); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from loadtests.load.workloads import WORKLOADS

DEFAULT_MAX_PROMPT_TOKENS = 4096  # synthetic prompts beyond this only slow a CPU run down


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="benchmark an OpenAI-compatible endpoint with a workload",
        description="Streams a workload's requests to URL's /v1/completions (prompts as token ids of the "
        "model directory's tokenizer) and reports TTFT, inter-token latency, TPOT, e2e latency, throughput "
        "and goodput, per traffic class and, from Duet's x-duet-* headers, per engine, variant and route reason.",
    )
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", required=True, help="model directory: its tokenizer builds the prompts")
    p.add_argument("--served-model-name", default=None,
                   help="the API's model name (default: the directory's name, as Duet serves it)")
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--trace", default=None, help="trace file for mooncake / azure-conv / azure-code "
                   "(default: the shipped trace of that name)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (default: 100; a trace's first N records, default all)")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests/s (inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="traces: multiplies arrival times (0.5 replays twice as fast)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt length cap (default: the model's context minus --max-tokens, at most "
                   f"{DEFAULT_MAX_PROMPT_TOKENS})")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="output tokens per request (traces: cap on the recorded output length)")
    p.add_argument("--mix", default=None,
                   help="--workload mix shares, e.g. multi_turn=0.4,agent=0.3,long_doc=0.2,chat=0.1 (the default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: mean inter-token latency (TPOT) bound")
    p.add_argument("--api-key", default=None, help="Bearer key for the endpoint")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--out", default=None, help="directory for summary.json, summary.md, records.jsonl, plots")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def _max_prompt_tokens(args: argparse.Namespace, model_dir) -> int:
    if args.max_prompt_tokens is not None:
        return args.max_prompt_tokens
    room = model_dir.config.max_position_embeddings - args.max_tokens
    if room < 64:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's "
                         f"{model_dir.config.max_position_embeddings}-token context")
    return min(room, DEFAULT_MAX_PROMPT_TOKENS)


def main(args: argparse.Namespace) -> int:
    from duet.model_dir import read_model_dir
    from duet.tokenizer import Tokenizer
    from loadtests.load.client import run_benchmark
    from loadtests.load.report import Slo, format_markdown, summarize, write_plots
    from loadtests.load.workloads import TokenSource, build_workload, parse_shares

    if args.rate is not None and args.concurrency is not None:
        raise ValueError("give --rate or --concurrency, not both")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.mix is not None and args.workload != "mix":
        raise ValueError("--mix applies to --workload mix only")
    if args.trace is not None and args.workload not in ("mooncake", "azure-conv", "azure-code"):
        raise ValueError(f"--trace applies to trace workloads only, not {args.workload}")
    model_dir = read_model_dir(args.model)
    tokenizer = Tokenizer.from_dir(args.model)
    src = TokenSource.from_model_dir(args.model)
    requests = build_workload(args.workload, src, args.num_requests, _max_prompt_tokens(args, model_dir),
                              args.max_tokens, seed=args.seed, trace=args.trace, time_scale=args.time_scale,
                              shares=parse_shares(args.mix) if args.mix else None)
    records = run_benchmark(args.url, args.served_model_name or Path(args.model).resolve().name, requests,
                            rate=args.rate, concurrency=args.concurrency, encode=tokenizer.encode,
                            api_key=args.api_key, timeout_s=args.timeout, progress=not args.no_progress,
                            seed=args.seed)
    summary = summarize(records, Slo(args.slo_ttft_ms, args.slo_itl_ms))
    table = format_markdown(summary)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "summary.md").write_text(table + "\n")
        with (out / "records.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps({k: v for k, v in asdict(r).items() if k != "prompt_token_ids"}) + "\n")
        write_plots(records, out)
    print(json.dumps(summary, indent=2) if args.json else table)
    if summary["num_ok"] == 0:
        first = next(r.error for r in records if r.error)
        print(f"duet bench run: error: no request succeeded; first error: {first}", file=sys.stderr)
        return 1
    return 0
