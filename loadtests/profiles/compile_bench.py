"""`--compile` against eager: decode step time at a few batch sizes, and start-up time cold and warm.

    python -m loadtests.profiles.compile_bench [--model DIR] [--threads 1] [--batches 1,16] [--steps 16]
                                               [--rounds 3] [--context 256] [--prefill 512] [--skip-startup]
                                               [--json OUT]

Decode: one eager and one compiled ModelRunner over the same model (the pulled SmolLM2-135M-Instruct unless
--model says otherwise), each sequence prefilled with `--context` tokens, then `--steps` decode steps per round,
eager and compiled rounds interleaved so a change in the machine's load hits both; medians per step, wall and CPU
(CPU time is the steadier figure on a shared machine); then one `--prefill`-token prefill step. Start-up: a fresh process loads the model three times:
eager, compiled over an empty inductor cache (cold), compiled again over that cache (warm); seconds from the
start of the load until the model can serve (weights loaded and, compiled, every graph warmed up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from duet.model_dir import read_model_dir
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool
from engine_core.model_runner import ModelRunner

PAGE = 16


def _runner(model: str, compile: bool, num_pages: int = 8) -> ModelRunner:
    md = read_model_dir(model)
    c = md.config
    pool = KVPool(c.num_hidden_layers, num_pages, PAGE, c.num_key_value_heads, c.head_dim, "float32", "cpu")
    return ModelRunner(md, pool, "cpu", compile=compile)


def _decode_rounds(runners: dict, batch: int, context: int, steps: int, rounds: int) -> dict:
    """name -> (wall ms, CPU ms) medians per decode step; each runner has its own pool, same pages."""
    per_seq = -(-(context + steps * rounds + 1) // PAGE)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompt = list(range(5, 5 + context))
    for r in runners.values():
        r.forward([SeqChunk(prompt, 0, p, (context - 1,)) for p in pages])
    times: dict = {name: ([], []) for name in runners}
    pos = context
    for _ in range(rounds):
        for name, r in runners.items():
            for s in range(steps):
                chunks = [SeqChunk([7], pos + s, p, (0,)) for p in pages]
                wall, cpu = time.perf_counter(), time.process_time()
                r.forward(chunks)
                times[name][0].append(time.perf_counter() - wall)
                times[name][1].append(time.process_time() - cpu)
        pos += steps
    return {name: {"wall_ms": round(statistics.median(w) * 1e3, 2), "cpu_ms": round(statistics.median(c) * 1e3, 2)}
            for name, (w, c) in times.items()}


def _prefill_rounds(runners: dict, tokens: int, rounds: int) -> dict:
    """name -> (wall ms, CPU ms) medians of one prefill step of `tokens` new tokens (one sequence)."""
    pages = list(range(-(-tokens // PAGE)))
    prompt = [5 + i % 1000 for i in range(tokens)]
    times: dict = {name: ([], []) for name in runners}
    for _ in range(rounds):
        for name, r in runners.items():
            wall, cpu = time.perf_counter(), time.process_time()
            r.forward([SeqChunk(prompt, 0, pages, (tokens - 1,))])
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.process_time() - cpu)
    return {name: {"wall_ms": round(statistics.median(w) * 1e3, 2), "cpu_ms": round(statistics.median(c) * 1e3, 2)}
            for name, (w, c) in times.items()}


def _report(what: str, figures: dict) -> None:
    e, c = figures["eager"], figures["compiled"]
    print(f"{what}: eager {e['wall_ms']} ms wall / {e['cpu_ms']} ms CPU, compiled {c['wall_ms']} / {c['cpu_ms']} "
          f"(CPU ratio {e['cpu_ms'] / c['cpu_ms']:.2f}x)")


def _startup(model: str, compile: bool, cache: str) -> float:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-m", "loadtests.profiles.compile_bench", "--model", model,
                          "--startup-only", "compile" if compile else "eager"], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["load_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.profiles.compile_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the pulled SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a worker's share of the cores)")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=16, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved eager / compiled rounds")
    p.add_argument("--context", type=int, default=256, help="tokens in each sequence's KV before decoding")
    p.add_argument("--prefill", type=int, default=512, help="tokens of one prefill step also timed (0: none)")
    p.add_argument("--skip-startup", action="store_true", help="decode and prefill only")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--startup-only", choices=("eager", "compile"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from duet.model_pull import pull
        from duet.model_registry import DEFAULT_MODEL

        args.model = str(pull(DEFAULT_MODEL))
    if args.startup_only:
        start = time.perf_counter()
        _runner(args.model, args.startup_only == "compile")
        print(json.dumps({"load_s": round(time.perf_counter() - start, 2)}))
        return 0
    startup = None
    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as cache:
            startup = {"eager_s": _startup(args.model, False, cache),
                       "compiled_cold_s": _startup(args.model, True, cache),
                       "compiled_warm_s": _startup(args.model, True, cache)}
        print(f"start-up: {startup}")
    batches = [int(b) for b in args.batches.split(",")]
    pages = max(max(batches) * -(-(args.context + args.steps * args.rounds + 1) // PAGE), -(-args.prefill // PAGE))
    runners = {"eager": _runner(args.model, False, pages), "compiled": _runner(args.model, True, pages)}
    decode = {}
    with torch.inference_mode():
        for b in batches:
            decode[b] = _decode_rounds(runners, b, args.context, args.steps, args.rounds)
            _report(f"decode batch {b}", decode[b])
        prefill = _prefill_rounds(runners, args.prefill, args.rounds) if args.prefill else None
        if prefill:
            _report(f"prefill {args.prefill} tokens", prefill)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "context": args.context, "startup": startup, "decode": decode,
                       "prefill": prefill}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
