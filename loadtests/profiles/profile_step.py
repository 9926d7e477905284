"""Where one engine step's time goes: torch.profiler over a decode-heavy and a prefill-heavy step.

    python -m loadtests.profiles.profile_step [--model DIR] [--threads N] [--top 15] [--steps 3]
                                              [--quantization none|int8] [--dtype float32|bfloat16]
                                              [--panel-rows-against N]

Runs the model runner and the sampler directly (no scheduler, no gRPC) on a model of SmolLM2-135M's shape
(the `smollm2` preset, random weights, made once) unless --model names another directory. The two steps are
the ones the peer benchmark's `unique` load spends its time in:

  decode:  16 sequences, one new token each, over ~600 cached tokens (512-token prompts mid-generation);
  prefill: 4 prompts of 512 new tokens in one step (the default 2048-token step budget).

The KV pages hold zeros (timing does not depend on their values). For each step it prints the wall and CPU time
per step and the profiler's top ops by self CPU time, so the shares show which cost to attack next.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from duet.model_dir import read_model_dir
from engine_core import cpu_linear
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool
from engine_core.model_runner import ModelRunner
from engine_core.sampler import Sampler, SampleRow
from engine_core.sampling_params import SamplingParams

PAGE_SIZE = 16


def decode_chunks(num_seqs: int, context: int, pages_per_seq: int) -> list[SeqChunk]:
    """One decode token per sequence at position context + i (ragged by a few tokens, as in real batches)."""
    chunks = []
    for i in range(num_seqs):
        pages = list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
        chunks.append(SeqChunk([100 + i], context + i, pages))
    return chunks


def prefill_chunks(num_seqs: int, length: int, pages_per_seq: int) -> list[SeqChunk]:
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for i in range(num_seqs):
        ids = torch.randint(3, 40000, (length,), generator=gen).tolist()
        chunks.append(SeqChunk(ids, 0, list(range(i * pages_per_seq, (i + 1) * pages_per_seq))))
    return chunks


def run_step(runner: ModelRunner, sampler: Sampler, chunks: list[SeqChunk], rows: list[SampleRow]) -> list[int]:
    logits = runner.forward(chunks)
    return sampler.sample(logits, rows).token_ids


def profile_step(name: str, runner, sampler, chunks, rows, steps: int, top: int) -> dict:
    run_step(runner, sampler, chunks, rows)  # warm-up: first-call allocations and lazy init
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run_step(runner, sampler, chunks, rows)
    wall = (time.perf_counter() - start) / steps
    cpu = (time.process_time() - cpu_start) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(runner, sampler, chunks, rows)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    tokens = sum(len(c.token_ids) for c in chunks)
    # CPU seconds are the steadier figure on a shared machine: waiting for a core does not count
    print(f"== {name}: {len(chunks)} sequences, {tokens} new tokens, {wall * 1000:.1f} ms/step wall, "
          f"{cpu * 1000:.1f} ms/step CPU (mean of {steps}, unprofiled)")
    print(table)
    return {"step": name, "ms_per_step": round(wall * 1000, 2), "cpu_ms_per_step": round(cpu * 1000, 2),
            "tokens": tokens}


def panel_rows_ab(runner, sampler, chunks, rows, steps: int, against: int, clock=time.perf_counter) -> dict:
    """The decode step with bf16 calls of up to cpu_linear.PANEL_ROWS rows on Duet's AMX panels, alternating step by
    step with `against` as the limit (0: oneDNN for every call) in this process, so that the machine's drift between
    sittings falls on both sides alike; the median of the pairs' ratios."""
    default = cpu_linear.PANEL_ROWS
    times: dict[int, list[float]] = {default: [], against: []}
    try:
        for _ in range(steps):
            for limit in (default, against):
                cpu_linear.PANEL_ROWS = limit
                start = clock()
                run_step(runner, sampler, chunks, rows)
                times[limit].append(clock() - start)
    finally:
        cpu_linear.PANEL_ROWS = default
    ratio = statistics.median(a / b for a, b in zip(times[default], times[against]))
    print(f"== decode, bf16 calls on the panels up to {default} rows against {against}: "
          f"{statistics.median(times[default]) * 1000:.1f} against {statistics.median(times[against]) * 1000:.1f} "
          f"ms/step, ratio {ratio:.3f} (median of {steps} pairs)")
    return {"panel_rows": default, "against": against, "ratio": round(ratio, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.profiles.profile_step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the smollm2-shape checkpoint)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--steps", type=int, default=3, help="unprofiled steps timed per kind")
    parser.add_argument("--quantization", default="none", choices=("none", "int8"),
                        help="int8: the weights as --quantization int8 serves them (DUET_CPU_PACKED_WEIGHTS=0: "
                             "the unpacked fp32 baseline)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights, activations and KV cache in this dtype (the worker's --dtype)")
    parser.add_argument("--top", type=int, default=15, help="ops listed per step")
    parser.add_argument("--decode-seqs", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=600)
    parser.add_argument("--prefill-seqs", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--panel-rows-against", type=int, default=None, metavar="N",
                        help="bf16 on AMX: time decode steps alternating the panels' row limit with N (0: oneDNN "
                             "for every call) instead of profiling")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from duet.model_make import cached_model_dir

        args.model = cached_model_dir("smollm2", "llama")
    md = read_model_dir(args.model)
    c = md.config
    longest = max(args.decode_context + args.decode_seqs, args.prefill_len)
    pages_per_seq = -(-longest // PAGE_SIZE)
    num_pages = pages_per_seq * max(args.decode_seqs, args.prefill_seqs)
    pool = KVPool(c.num_hidden_layers, num_pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim, args.dtype, "cpu")
    runner = ModelRunner(md, pool, "cpu", args.dtype, quantization=args.quantization)
    sampler = Sampler(c.vocab_size, c.eos_token_ids, seed=0)
    print(f"model {md.model_id}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}; "
          f"torch threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()}")
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    dec = decode_chunks(args.decode_seqs, args.decode_context, pages_per_seq)
    dec_rows = [SampleRow(greedy, [1] * args.decode_context, []) for _ in dec]
    if args.panel_rows_against is not None:
        for _ in range(3):  # warm-up
            run_step(runner, sampler, dec, dec_rows)
        panel_rows_ab(runner, sampler, dec, dec_rows, args.steps, args.panel_rows_against)
        return 0
    profile_step("decode", runner, sampler, dec, dec_rows, args.steps, args.top)
    pre = prefill_chunks(args.prefill_seqs, args.prefill_len, pages_per_seq)
    pre_rows = [SampleRow(greedy, c.token_ids, []) for c in pre]
    profile_step("prefill", runner, sampler, pre, pre_rows, max(1, args.steps // 2), args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
