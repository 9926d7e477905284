"""Kernel tile sweeps: `python -m engine_core.kernels.tune extend [--tiles ...] [--json] [--out FILE]`.

`extend` runs the extend-attention kernel (extend_attention.py) with each (BLOCK_M, BLOCK_N, warps, stages) tile
on each shape, checks every output against the torch reference, and on CUDA times it (triton.testing.do_bench)
and gives its FLOP rate, as the bench counts it (engine_core/kernels/bench.py). The shapes on CUDA are the
bench's three (bf16, 32 q / 8 kv heads, d 128, page 16); the tiles are the ones the 2026-12-04 H200 sweep tried
(docs/data/h200-extend-tiles-and-decode-graphs-2026-12-04.json) plus the interpreter's. Without CUDA it runs in
Triton's interpreter (TRITON_INTERPRET=1, set by re-running itself) on tiny ragged shapes where every tile is
larger than some sequence: a check of correctness and bounds only, with no times.

A tile the kernel cannot run is rejected before launch (bounds.tile_problem). A launch that raises is recorded
with its message; after a CUDA error (an illegal memory access leaves the CUDA context unusable) the sweep stops
and says which tiles did not run. Inputs are checked for bounds once per shape (bounds.py) before any launch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from importlib import import_module

import torch

from engine_core.kernels._jit import interpreting
from engine_core.kernels.bounds import check_page_tables, check_query_ranges, tile_problem

# the module, not the package's `extend_attention` function of the same name
extend = import_module("engine_core.kernels.extend_attention")

# (BLOCK_M, BLOCK_N, warps, stages): the tiles of the H200 sweep, the current default first
GPU_TILES = (extend.GPU_TILE, (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
             (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3))
INTERPRETER_TILES = ((16, 16, 4, 2), (32, 16, 4, 2), (16, 64, 4, 2), (128, 128, 8, 2), (64, 128, 4, 3))
# (atol, rtol) against the fp32-computing reference, as tests/kernels uses
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@dataclass(frozen=True)
class Shape:
    name: str
    prefixes: tuple[int, ...]  # cached tokens before each sequence's chunk
    news: tuple[int, ...]  # new tokens of each sequence
    page_size: int
    hq: int
    hk: int
    d: int

    @property
    def flops(self) -> int:
        """Two matmuls (QK^T, PV), 2 FLOPs per multiply-add, over the visible (causal) keys (as bench.py)."""
        visible = sum(n * p + n * (n + 1) // 2 for p, n in zip(self.prefixes, self.news))
        return 4 * visible * self.hq * self.d


H200_SHAPES = (Shape("4k", (0,), (4096,), 16, 32, 8, 128), Shape("2k+2k", (2048,), (2048,), 16, 32, 8, 128),
               Shape("8x512+1k", (1024,) * 8, (512,) * 8, 16, 32, 8, 128))
# ragged: a chunk of 1, chunks ending mid-page and mid-tile, a prefix of 0 and one past a 64-key block; d 40
# (not a power of two) exercises the head-dim mask
TINY_SHAPES = (Shape("ragged", (0, 19, 70, 5), (37, 1, 9, 0), 4, 4, 2, 32),
               Shape("d40-page16", (33,), (70,), 16, 2, 1, 40))


def make_inputs(shape: Shape, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """Extend-attention arguments: a paged cache with each sequence's pages scattered, spare pages no sequence
    owns, and one table column past every sequence's pages pointing at other sequences' pages."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(p + n) // shape.page_size) for p, n in zip(shape.prefixes, shape.news)]
    num_pages = sum(pages) + 2
    cache_shape = (num_pages, shape.page_size, shape.hk, shape.d)
    # made on the CPU from one seeded generator (whatever torch's default device), then moved
    k_cache = torch.randn(cache_shape, generator=g, device="cpu").to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=g, device="cpu").to(dtype).to(device)
    order = torch.randperm(num_pages, generator=g, device="cpu")
    table = torch.randint(0, num_pages, (len(pages), max(pages) + 1), generator=g, dtype=torch.int32, device="cpu")
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[at: at + n].to(torch.int32)
        at += n
    q = torch.randn(sum(shape.news), shape.hq, shape.d, generator=g, device="cpu").to(dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(shape.news, device="cpu").cumsum(0).tolist()], dtype=torch.int32, device=device)
    prefixes = torch.tensor(shape.prefixes, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, table.to(device), cu, prefixes, shape.d**-0.5


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def sweep_extend(tiles, shapes, dtype: torch.dtype, timed: bool, device: str) -> list[dict]:
    """One row per tile: its status (passed; wrong: outside the tolerance; rejected: the launcher refuses it;
    too_big: not enough shared memory or registers on this device; error: the launch raised; not_run: after a CUDA
    error) and, per shape, the max error against the reference and (timed) ms and TFLOP/s."""
    cases = []
    for shape in shapes:
        args = make_inputs(shape, dtype, device)
        q, k_cache, _, table, cu, prefixes, _ = args
        check_query_ranges("tune", cu, q.shape[0], max(shape.news))
        check_page_tables("tune", table, prefixes.long() + cu[1:] - cu[:-1], shape.page_size, k_cache.shape[0])
        cases.append((shape, args, extend.extend_attention_ref(*args)))
    atol, rtol = TOLERANCE[dtype]
    rows: list[dict] = []
    lost_context = None
    for tile in tiles:
        row: dict = {"tile": list(tile), "status": "passed", "shapes": {}}
        rows.append(row)
        if lost_context is not None:
            row.update(status="not_run", reason=f"the CUDA context was lost at tile {lost_context}")
            continue
        if (problem := tile_problem(*tile)) is not None:
            row.update(status="rejected", reason=problem)
            continue
        for shape, args, ref in cases:
            run = functools.partial(extend.extend_attention_triton, *args, max_seqlen_q=max(shape.news), tile=tile)
            try:
                out = run()
                if device == "cuda":
                    torch.cuda.synchronize()  # an asynchronous fault surfaces here, charged to this tile
            except Exception as exc:  # noqa: BLE001 - a compile failure, too little shared memory, a CUDA fault
                # too little shared memory or registers on this device is a tile that does not fit, not a bug
                status = "too_big" if type(exc).__name__ == "OutOfResources" else "error"
                row.update(status=status, reason=f"{shape.name}: {type(exc).__name__}: {exc}"[:2000])
                if device == "cuda" and status == "error" and "CUDA" in str(exc):
                    lost_context = list(tile)
                break
            err = float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0
            result = {"max_abs_err": err}
            if not torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol):
                row["status"] = "wrong"
            elif timed:
                ms = _time_ms(run)
                result.update(ms=round(ms, 4), tflops=round(shape.flops / (ms * 1e-3) * 1e-12, 1))
            row["shapes"][shape.name] = result
    return rows


def _best(rows: list[dict]) -> dict | None:
    timed = [r for r in rows if r["status"] == "passed" and all("tflops" in s for s in r["shapes"].values())]
    if not timed:
        return None
    best = max(timed, key=lambda r: statistics.mean(s["tflops"] for s in r["shapes"].values()))
    return {"tile": best["tile"], "mean_tflops": round(statistics.mean(s["tflops"] for s in best["shapes"].values()), 1)}


def run_extend(tiles=None, dtype_name: str | None = None) -> dict:
    cuda = torch.cuda.is_available() and not interpreting()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name or
                                                                                   ("bf16" if cuda else "fp32")]
    shapes = H200_SHAPES if cuda else TINY_SHAPES
    tiles = tiles or (GPU_TILES if cuda else INTERPRETER_TILES)
    rows = sweep_extend(tiles, shapes, dtype, timed=cuda, device="cuda" if cuda else "cpu")
    report = {
        "kernel": "extend_attention", "command": "python -m engine_core.kernels.tune extend",
        "mode": "cuda: checked against the reference and timed (triton.testing.do_bench)" if cuda else
                "interpreter (TRITON_INTERPRET=1): checked against the reference only; no times",
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "default_tile": {"gpu": list(extend.GPU_TILE), "interpreter": list(extend.INTERPRETER_TILE)},
        "shapes": [asdict(s) for s in shapes], "tiles": rows,
        "passed": sum(r["status"] == "passed" for r in rows), "failed": sum(r["status"] in ("wrong", "error") for r in rows),
    }
    if cuda:
        import triton

        report["triton"] = triton.__version__
        report["best"] = _best(rows)
    return report


def _parse_tiles(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """"128x128x8x2,64x64x4x3" -> tiles."""
    tiles = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"a tile is BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 128x128x8x2; got {item!r}")
        tiles.append(tuple(int(p) for p in parts))
    return tuple(tiles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_core.kernels.tune", description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["extend"])
    parser.add_argument("--tiles", type=_parse_tiles, default=None,
                        help="BLOCK_MxBLOCK_NxWARPSxSTAGES, comma-separated (default: the H200 sweep's on CUDA)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="default bf16 on CUDA, fp32 in the interpreter")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not interpreting():
        # Triton reads TRITON_INTERPRET when it is imported (tests/conftest.py): run again with it set
        env = dict(os.environ, TRITON_INTERPRET="1")
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "engine_core.kernels.tune", *argv], env)
    report = run_extend(args.tiles, args.dtype)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    human = sys.stderr if args.json else sys.stdout
    if args.json:
        print(text)
    print(f"extend tiles on {report['device']} ({report['mode']}):", file=human)
    for r in report["tiles"]:
        figures = "  ".join(f"{k} err {v['max_abs_err']:.2g}" + (f" {v['tflops']} TFLOP/s" if "tflops" in v else "")
                            for k, v in r["shapes"].items())
        print(f"  {'x'.join(map(str, r['tile'])):14} {r['status']:8} {figures} {r.get('reason', '')}", file=human)
    if report.get("best"):
        print(f"best: {report['best']}", file=human)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
