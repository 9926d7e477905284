"""One decode-shaped and one prefill-shaped matmul, each way the CPU engine can run it.

    python -m loadtests.profiles.matmul_bench [--threads 1] [--repeats 7] [--layers 30] [--rows 1,16,512]
        [--shapes gate_up,lm_head] [--ways all]

The weights are SmolLM2-135M's: by default its gate_up projection ([3072, 576]) and its tied LM head ([49152,
576]); `--shapes` adds the others of a layer (qkv, o, down). One distinct copy per layer for the projections,
so the weights stream from memory as in a real step instead of sitting in cache. Rows: 1 (one sequence
decoding), 16 (a decode step of 16 sequences) and 512 (one prefill chunk) by default; a 4 x 512 prefill step is
2048. `--ways bf16,bf16_duet` times only those (the others are slow at prefill sizes). Ways:

  rowmajor  F.linear on the checkpoint's [out, in] weight (MKL re-packs it in every call)
  colmajor  F.linear on the same values stored transposed (the engine's layout before packing)
  packed    engine_core.cpu_linear.PackedLinear (oneDNN blocked layout, packed once)
  int8      engine_core.cpu_linear.Int8Linear (--quantization int8): the bf16-dot kernel where the CPU has
            AVX512_BF16 (engine_core/kernels/cpu_int8_linear.py), else torch's kernel
  int8_torch  the same weights through torch's `_weight_int8pack_mm` (shown where the native kernel serves)
  q8_0      engine_core.cpu_linear.GroupedInt8Linear: int8 in blocks of 32 with a scale each, as a GGUF Q8_0 file
            is served with --quantization int8 (engine_core/kernels/cpu_int8_grouped.py, fp32 FMAs, AVX2)
  bf16      PackedLinear over bf16 weights, bf16 rows (oneDNN uses AMX where the CPU has it): how `--dtype
            bfloat16` runs every matmul on an AMX CPU (engine_core/cpu_linear.py); left out on CPUs oneDNN has no
            bf16 path for
  bf16_duet Duet's bf16 kernel (engine_core/kernels/cpu_bf16_linear.py), shown where the CPU has AVX512_BF16;
            what `--dtype bfloat16` runs on such a CPU without AMX (the others run `bf16`)
  bf16_rowmajor, bf16_colmajor  F.linear on the bf16 weight as the checkpoint stores it, and transposed in memory
            (how a bf16 model ran before its matmuls were packed: colmajor)

Each figure is the fastest of `--repeats` interleaved rounds (ms per matmul): on a shared machine the
minimum is the figure least disturbed by other processes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine_core.cpu_linear import GroupedInt8Linear, Int8Linear, PackedLinear
from engine_core.kernels import cpu_bf16_linear

SHAPES = {"gate_up": (3072, 576), "lm_head": (49152, 576), "qkv": (960, 576), "o": (576, 576), "down": (576, 1536)}


def _ways(weights: list[torch.Tensor]) -> dict:
    col = [w.t().contiguous().t() for w in weights]
    packed = [PackedLinear(w, None) for w in weights]
    int8 = [Int8Linear.from_float(w, None) for w in weights]
    q8_0 = [GroupedInt8Linear.from_float(w, None) for w in weights]
    ways = {
        "rowmajor": lambda x: [F.linear(x, w) for w in weights],
        "colmajor": lambda x: [F.linear(x, w) for w in col],
        "packed": lambda x: [m(x) for m in packed],
        "int8": lambda x: [m(x) for m in int8],
        "q8_0": lambda x: [m(x) for m in q8_0],
    }
    if int8[0].native:
        int8_torch = [Int8Linear.from_float(w, None, native=False) for w in weights]
        ways["int8_torch"] = lambda x: [m(x) for m in int8_torch]
    # oneDNN packs bf16 weights only where the CPU has bf16 conversions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT);
    # an AVX2-only CPU has no bf16 way to measure.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16 = [PackedLinear(w.bfloat16(), None) for w in weights]
        ways["bf16"] = lambda x: [m(x.bfloat16()) for m in bf16]
        b16 = [w.bfloat16() for w in weights]
        b16_col = [w.t().contiguous().t() for w in b16]
        ways["bf16_rowmajor"] = lambda x: [F.linear(x.bfloat16(), w) for w in b16]
        ways["bf16_colmajor"] = lambda x: [F.linear(x.bfloat16(), w) for w in b16_col]
    if cpu_bf16_linear.vector_path():  # Duet's kernel, on CPUs with AVX512_BF16
        panels = [cpu_bf16_linear.pack_bf16(w.bfloat16()) for w in weights]
        n = weights[0].shape[0]
        ways["bf16_duet"] = lambda x: [cpu_bf16_linear.bf16_linear_native(x.bfloat16(), p, None, n) for p in panels]
    return ways


def bench(shape: tuple[int, int], rows: int, layers: int, repeats: int, only: set[str] | None = None
          ) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02 for _ in range(layers)]
    x = torch.randn(rows, shape[1], generator=gen)
    ways = {k: fn for k, fn in _ways(weights).items() if only is None or k in only}
    best = dict.fromkeys(ways, float("inf"))
    with torch.inference_mode():
        for fn in ways.values():
            fn(x)  # first call: oneDNN primitive creation, fbgemm's first-use set-up
        for _ in range(repeats):
            for name, fn in ways.items():
                start = time.perf_counter()
                fn(x)
                best[name] = min(best[name], (time.perf_counter() - start) / layers * 1000)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.profiles.matmul_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30, help="distinct weight copies (the head uses a third)")
    parser.add_argument("--rows", default="1,16,512", help="comma-separated row counts")
    parser.add_argument("--shapes", default="gate_up,lm_head", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--ways", default="all", help="comma-separated ways (module doc); the first is the base")
    args = parser.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SHAPES)}")
    only = None if args.ways == "all" else args.ways.split(",")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}; "
          f"ms per matmul, fastest of {args.repeats}")
    for label in args.shapes.split(","):
        shape = SHAPES[label]
        layers = max(1, args.layers // 3) if shape[0] > 10000 else args.layers
        for rows in (int(r) for r in args.rows.split(",")):
            best = bench(shape, rows, layers, args.repeats, None if only is None else set(only))
            base = best[only[0] if only else "rowmajor"]
            shown = "  ".join(f"{k} {v:7.3f} ({base / v:4.2f}x)" for k, v in best.items())
            print(f"{label} {list(shape)} x {rows:4d} rows: {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
