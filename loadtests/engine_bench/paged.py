"""`python -m loadtests.engine_bench paged [--quick] --json`: engine_paged on the `bench`
checkpoint, CPU, in process (the scheduler + model runner loop, no gRPC). Fields:

- kv_utilization: over the steps of a 64-request run with random lengths, the mean of
  live tokens / (allocated pages x page size); kv_utilization_contiguous_baseline: the same steps
  if each running request had reserved prompt + max_tokens slots contiguously at admission.
- throughput_tok_s: output tokens/s for 32 requests submitted at once (greedy, exact lengths);
  speedup_vs_hf_sequential / speedup_vs_hf_static_batch: against transformers' generate on the
  same checkpoint and prompts, one request at a time and as one left-padded batch;
  the `_cpu` variants are the same ratios over this process's CPU seconds (with one thread, less
  disturbed by other jobs on a shared machine).
- n8_page_ratio: peak pages of one request with n=8 over peak pages of 8 independent copies,
  1,024-token prompt.
"""

from __future__ import annotations

import time

import torch

from engine_core.request import Request
from loadtests.engine_bench.common import (
    Workload,
    bench_checkpoint,
    bench_device,
    drive,
    greedy,
    hf_model,
    hf_sequential,
    hf_static_batch,
    random_workload,
)

SIZES = {
    # util: (requests, prompt range, output range); tput: same for the throughput run;
    # hf_seq_requests: how many of the throughput requests the sequential baseline runs (its rate is per token)
    "full": {"util": (64, (32, 512), (32, 256)), "tput": (32, (32, 512), (32, 256)), "hf_seq_requests": 32,
             "n8_tokens": 64},
    "quick": {"util": (64, (32, 512), (8, 24)), "tput": (32, (16, 128), (8, 48)), "hf_seq_requests": 6,
              "n8_tokens": 8},
}


def _engine(checkpoint, enable_prefix_caching: bool = True, **kw):
    from duet.engine_config import EngineConfig, PagedConfig
    from engine_paged.worker import build_engine

    return build_engine(PagedConfig(EngineConfig(model=str(checkpoint), device=bench_device(), **kw),
                                    enable_prefix_caching=enable_prefix_caching))


def _requests(work: Workload, prefix: str, **kw) -> list[Request]:
    return [Request(f"{prefix}{i}", p, greedy(m, **kw)) for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens))]


def kv_utilization(checkpoint, work: Workload, page_size: int) -> dict:
    parts = _engine(checkpoint, page_size=page_size, kv_cache_tokens=sum(len(p) + m for p, m in
                                                                          zip(work.prompts, work.max_tokens)))
    sched, bm = parts.scheduler, parts.scheduler.bm
    paged, contiguous = [], []

    def on_step(_seconds, _outputs):
        live = sum(bm.num_tokens(s.seq_id) for g in sched.running for s in g.seqs if s.seq_id in bm)
        if bm.num_used_pages:
            paged.append(live / (bm.num_used_pages * page_size))
            reserved = sum(len(g.request.prompt_token_ids) + g.request.params.max_tokens for g in sched.running)
            contiguous.append(live / reserved)

    drive(sched, parts.runner, _requests(work, "u"), on_step)
    return {"kv_utilization": round(sum(paged) / len(paged), 4),
            "kv_utilization_contiguous_baseline": round(sum(contiguous) / len(contiguous), 4),
            "kv_utilization_steps": len(paged)}


def _cpu(fn, *args):
    """(fn's result, CPU seconds of this process while it ran): with one torch thread, a rate that other
    jobs on a shared machine disturb much less than wall time (they still share caches and memory)."""
    start = time.process_time()
    result = fn(*args)
    return result, time.process_time() - start


def throughput(checkpoint, work: Workload, hf_seq_requests: int) -> dict:
    parts = _engine(checkpoint, kv_cache_tokens=65536, max_num_seqs=64)
    (_, seconds, steps), engine_cpu = _cpu(drive, parts.scheduler, parts.runner, _requests(work, "t"))
    engine_rate, engine_cpu_rate = work.output_tokens / seconds, work.output_tokens / engine_cpu
    model = hf_model(checkpoint)
    subset = Workload(work.prompts[:hf_seq_requests], work.max_tokens[:hf_seq_requests])
    seq_seconds, seq_cpu = _cpu(hf_sequential, model, subset)
    static_seconds, static_cpu = _cpu(hf_static_batch, model, work)
    seq_rate = subset.output_tokens / seq_seconds
    static_rate = work.output_tokens / static_seconds
    return {"throughput_tok_s": round(engine_rate, 2), "engine_seconds": round(seconds, 2), "engine_steps": steps,
            "hf_sequential_tok_s": round(seq_rate, 2), "hf_sequential_requests_measured": len(subset.prompts),
            "hf_static_batch_tok_s": round(static_rate, 2),
            "speedup_vs_hf_sequential": round(engine_rate / seq_rate, 2),
            "speedup_vs_hf_static_batch": round(engine_rate / static_rate, 2),
            # the same ratios over CPU seconds instead of wall seconds (a cross-check for noisy machines)
            "speedup_vs_hf_sequential_cpu": round(engine_cpu_rate / (subset.output_tokens / seq_cpu), 2),
            "speedup_vs_hf_static_batch_cpu": round(engine_cpu_rate / (work.output_tokens / static_cpu), 2)}


def n8_page_ratio(checkpoint, max_tokens: int, page_size: int = 16) -> dict:
    prompt = random_workload(1, (1024, 1024), (1, 1), 8000, seed=8).prompts[0]

    def peak(requests):
        # no prefix cache: the 8 copies must each hold the prompt, as the ratio means
        parts = _engine(checkpoint, page_size=page_size, kv_cache_tokens=8 * (1024 + max_tokens + page_size),
                        enable_prefix_caching=False)
        bm, most = parts.scheduler.bm, [0]
        drive(parts.scheduler, parts.runner, requests,
              lambda _t, _o: most.__setitem__(0, max(most[0], bm.num_used_pages)))
        return most[0]

    shared = peak([Request("n8", prompt, greedy(max_tokens, n=8, seed=0))])
    copies = peak([Request(f"c{i}", prompt, greedy(max_tokens)) for i in range(8)])
    return {"n8_page_ratio": round(shared / copies, 4), "n8_pages": shared, "n8_independent_pages": copies}


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    size = SIZES["quick" if quick else "full"]
    checkpoint = bench_checkpoint()
    start = time.perf_counter()
    result = {"mode": "paged", "quick": quick, "checkpoint": "bench", "device": bench_device(),
              "torch_threads": torch.get_num_threads()}
    n, plen, olen = size["util"]
    result.update(kv_utilization(checkpoint, random_workload(n, plen, olen, 8000, seed=1), page_size=16))
    n, plen, olen = size["tput"]
    result.update(throughput(checkpoint, random_workload(n, plen, olen, 8000, seed=2), size["hf_seq_requests"]))
    result.update(n8_page_ratio(checkpoint, size["n8_tokens"]))
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    return result
