"""The native CPU extend (prefill) attention (engine_core/kernels/csrc/paged_extend.c) against torch's SDPA path.

    python -m loadtests.profiles.extend_attention_bench [--threads 1] [--chunks 0:512,0:512,0:512,0:512]
                                                        [--repeats 7] [--dtype float32|bfloat16]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64, page 16), one layer of one prefill step:
`--chunks` lists each chunk as prefix:new (tokens cached before it, tokens it adds), 4 fresh prompts of 512 by
default. Prints the median and fastest ms per layer of each way: `native` (the kernel as built here; its tile
width says which path: 16 AVX-512, 8 AVX2, 1 portable C; over a bf16 cache, "amx", "avx512_bf16" or "fp32" says
how the blocks run; DUET_NATIVE_CPU_CFLAGS narrows it, e.g. `-mno-avx512bf16` for the fp32 tiles) and `torch`
(pages gathered, then torch's scaled_dot_product_attention), rounds interleaved. `--dtype` is the KV cache's (and
the queries'), as a worker's `--dtype` makes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_core.kernels import cpu_native
from engine_core.kernels.cpu_attention import paged_attention_planned, plan_paged_attention

HQ, HK, D, PAGE = 9, 3, 64, 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.profiles.extend_attention_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunks", default="0:512,0:512,0:512,0:512", help="prefix:new per chunk")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the KV cache's dtype")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    chunks = [tuple(int(x) for x in c.split(":")) for c in args.chunks.split(",")]
    pages = [-(-(p + n) // PAGE) for p, n in chunks]
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(sum(pages), PAGE, HK, D, generator=gen).to(dtype) for _ in range(2))
    tables = torch.zeros(len(chunks), max(pages), dtype=torch.int32)
    first = 0
    for i, n in enumerate(pages):
        tables[i, :n] = torch.arange(first, first + n)
        first += n
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, HQ, D, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, HK, D, generator=gen).to(dtype) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    prefix = torch.tensor([p for p, _ in chunks], dtype=torch.int32)
    no_decode = torch.zeros(0, dtype=torch.int32)
    plans = {"torch": plan_paged_attention(0, tables[:0], no_decode, tables, cu, prefix, PAGE, False)}
    if cpu_native.native_available():
        plans["native"] = plan_paged_attention(0, tables[:0], no_decode, tables, cu, prefix, PAGE, True)
    times: dict[str, list[float]] = {name: [] for name in plans}
    with torch.inference_mode():
        for plan in plans.values():
            paged_attention_planned(q, k, v, k_cache, v_cache, plan, D**-0.5)  # warm-up (the native build)
        for _ in range(args.repeats):
            for name, plan in plans.items():
                start = time.perf_counter()
                paged_attention_planned(q, k, v, k_cache, v_cache, plan, D**-0.5)
                times[name].append((time.perf_counter() - start) * 1000)
    tiles = f" ({cpu_native.extend_bf16_path()})" if dtype == torch.bfloat16 else ""
    print(f"chunks {args.chunks}, {args.threads} thread(s), {args.dtype}, native tile width {cpu_native.vector_floats()}{tiles}; "
          f"ms per layer, median / fastest of {args.repeats}")
    for name, ts in times.items():
        print(f"{name:6s} {statistics.median(ts):8.2f} / {min(ts):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
