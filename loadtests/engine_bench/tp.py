"""`python -m loadtests.engine_bench tp --tensor-parallel-size N [--preset bench|smollm2] [--quick] --json`:
engine_paged with its model split over N ranks (engine_core.parallel), in process (no gRPC), greedy, every
request arriving at t=0. Fields:

- throughput_tok_s: output tokens/s of the whole run; step_ms_mean: wall time per engine step;
- all_reduce_share: the fraction of rank 0's forward time spent inside the all-reduce wrapper
  (engine_core.parallel.layers.Collectives; on CUDA it synchronizes around each call for this benchmark);
  all_reduce_ms_per_step and all_reduce_calls_per_step with it; logits_gather_share: the same for the one
  gather of the vocabulary-parallel logits per step. TP = 1 runs the plain ModelRunner: these are 0.

`bench` has 8 heads and 2 KV heads (TP 1, 2, 4, 8); `smollm2` has SmolLM2-135M's shape, 9 heads and 3 KV heads
(TP 1, 3, 9). Both are random-weight checkpoints; tokens/s depends on the shape, not on the weights.
"""

from __future__ import annotations

import time

from engine_core.request import Request
from loadtests.engine_bench.common import bench_checkpoint, bench_device, drive, greedy, random_workload

SIZES = {"full": (32, (32, 512), (32, 128)), "quick": (8, (16, 64), (8, 16))}


def run(quick: bool, tensor_parallel_size: int = 1, preset: str = "bench") -> dict:
    from duet.engine_config import EngineConfig, PagedConfig
    from engine_paged.worker import build_engine

    num, prompt_len, output_len = SIZES["quick" if quick else "full"]
    checkpoint = bench_checkpoint(preset)
    parts = build_engine(PagedConfig(EngineConfig(model=str(checkpoint), device=bench_device(), kv_cache_tokens=32768,
                                                  max_num_seqs=64, tensor_parallel_size=tensor_parallel_size)))
    runner = parts.runner
    tp = tensor_parallel_size > 1
    if tp:
        runner.time_collectives_exactly()
    try:
        work = random_workload(num, prompt_len, output_len, parts.spec.vocab_size, seed=3)
        requests = [Request(f"tp{i}", p, greedy(m)) for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens))]
        before = runner.stats() if tp else {}  # the start's warm-up token is not part of the run
        _, seconds, steps = drive(parts.scheduler, runner, requests)
        stats = {k: v - before[k] for k, v in runner.stats().items()} if tp else {}
    finally:
        if tp:
            runner.close()
    forward = stats.get("forward_seconds") or 1.0
    return {"mode": "tp", "quick": quick, "checkpoint": preset, "device": bench_device(),
            "tensor_parallel_size": tensor_parallel_size, "requests": num, "output_tokens": work.output_tokens,
            "throughput_tok_s": round(work.output_tokens / seconds, 2), "engine_seconds": round(seconds, 2),
            "engine_steps": steps, "step_ms_mean": round(1000 * seconds / steps, 2),
            "all_reduce_share": round(stats.get("all_reduce_seconds", 0.0) / forward, 4),
            "all_reduce_ms_per_step": round(1000 * stats.get("all_reduce_seconds", 0.0) / steps, 3),
            "all_reduce_calls_per_step": round(stats.get("all_reduce_calls", 0) / steps, 1),
            "logits_gather_share": round(stats.get("gather_seconds", 0.0) / forward, 4),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
