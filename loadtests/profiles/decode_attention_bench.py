"""The native CPU decode attention (engine_core/kernels/csrc/paged_decode.c) over contiguous and scattered pages.

    python -m loadtests.profiles.decode_attention_bench [--threads 1] [--rows 16] [--context 600]
                                                        [--page-sizes 8,16,32,64] [--repeats 5]
                                                        [--dtype float32|bfloat16] [--against CHECKOUT]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64, 30 layers, each layer its own cache so the
K/V rows stream from memory), one decode token per row. `contiguous`: each row's pages one after another, as in
a fresh pool; `scattered`: the same pages in a shuffled order, as a busy pool hands them out. Prints the median
ms for the 30 layers and the K/V bytes read per second. `--dtype bfloat16`: the caches in bf16, as a bf16 model
keeps them (half the bytes; the kernel built for them, csrc/kv_type.h), the queries fp32 as the model passes them.

`--against CHECKOUT`: another checkout's kernel (its engine_core/kernels/csrc, built as this one's is) on the same
caches, the two alternating step by step (the order swapped every repeat); prints both medians and the median of the
per-repeat ratios (this checkout's over the other's). A VM's memory rate drifts by tens of percent over seconds, so
two runs one after the other compare the drift; steps taken in turn share it.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from pathlib import Path

import torch

from engine_core.kernels import cpu_native
from engine_core.kernels.cpu_native import native_available
from engine_core.kernels.cpu_paged_decode import paged_decode_native

HQ, HK, D, LAYERS = 9, 3, 64, 30


def _caches(rows: int, context: int, page_size: int, scattered: bool, dtype: torch.dtype):
    """Each layer's K and V caches, the rows' page tables, context lengths and queries."""
    per_row = -(-context // page_size)
    pool = rows * per_row * 2  # room to scatter into
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(pool, page_size, HK, D, generator=gen).to(dtype),
               torch.randn(pool, page_size, HK, D, generator=gen).to(dtype)) for _ in range(LAYERS)]
    ids = list(range(pool))
    if scattered:
        random.Random(0).shuffle(ids)
    tables = torch.tensor(ids[:rows * per_row], dtype=torch.int32).reshape(rows, per_row)
    lens = torch.full((rows,), context, dtype=torch.int32)
    q = torch.randn(rows, HQ, D, generator=gen)
    return caches, tables, lens, q


def bench(rows: int, context: int, page_size: int, scattered: bool, repeats: int,
          dtype: torch.dtype = torch.float32) -> float:
    caches, tables, lens, q = _caches(rows, context, page_size, scattered, dtype)

    def step():
        for k, v in caches:
            paged_decode_native(q, k, v, tables, lens, D ** -0.5, context)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def other_kernel(checkout: Path):
    """`CHECKOUT`'s paged decode kernel, built from its sources, called as this checkout's is."""
    lib = cpu_native.load_attention("cpu_attention_against", checkout / "engine_core" / "kernels" / "csrc",
                                    f"{checkout} cannot be compared")
    if lib is None:
        raise SystemExit(f"decode_attention_bench: the kernels of {checkout} did not build")
    return functools.partial(paged_decode_native, lib=lib)


def bench_against(rows: int, context: int, page_size: int, scattered: bool, repeats: int, dtype: torch.dtype,
                  other) -> tuple[float, float, float]:
    """(this checkout's median ms, the other's, the median of the per-repeat ratios), the steps in turn."""
    caches, tables, lens, q = _caches(rows, context, page_size, scattered, dtype)
    kernels = {"this": paged_decode_native, "other": other}
    times: dict[str, list[float]] = {"this": [], "other": []}
    for r in range(repeats + 1):  # the first round warms both up
        for side in (("this", "other") if r % 2 else ("other", "this")):
            t0 = time.perf_counter()
            for k, v in caches:
                kernels[side](q, k, v, tables, lens, D ** -0.5, context)
            if r:
                times[side].append(time.perf_counter() - t0)
    ratio = statistics.median(a / b for a, b in zip(times["this"], times["other"]))
    return statistics.median(times["this"]) * 1000, statistics.median(times["other"]) * 1000, ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.profiles.decode_attention_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--page-sizes", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the KV caches' dtype")
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout: its kernel alternating with this one's (module doc)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not native_available():
        parser.error("the native decode attention is not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    moved = args.rows * args.context * LAYERS * 2 * HK * D * dtype.itemsize  # K and V rows read once
    print(f"{args.rows} rows x {args.context} context, {LAYERS} layers, {args.threads} thread(s), {args.dtype} K/V; "
          f"median ms of {args.repeats}, K/V GB/s")
    other = other_kernel(args.against) if args.against is not None else None
    for page_size in (int(x) for x in args.page_sizes.split(",")):
        if other is not None:
            for scattered in (False, True):
                this, theirs, ratio = bench_against(args.rows, args.context, page_size, scattered, args.repeats,
                                                    dtype, other)
                print(f"page {page_size:3d} {'scattered' if scattered else 'contiguous'}: this {this:6.1f} ms, "
                      f"{args.against} {theirs:6.1f} ms, this / that {ratio:.3f} (median of {args.repeats} pairs)")
            continue
        shown = []
        for scattered in (False, True):
            ms = bench(args.rows, args.context, page_size, scattered, args.repeats, dtype)
            shown.append(f"{'scattered' if scattered else 'contiguous'} {ms:6.1f} ms ({moved / ms / 1e6:5.1f} GB/s)")
        print(f"page {page_size:3d}: " + "  ".join(shown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
