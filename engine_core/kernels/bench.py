"""Kernel benchmark (a script, not a test): `python -m engine_core.kernels.bench [--json]`.

Per kernel and shape: the time of the Triton kernel and of the torch reference, with the achieved memory
bandwidth (decode, elementwise ops) or FLOP rate (extend). On CUDA, times come from triton.testing.do_bench and
the run also measures the device's copy bandwidth and dense bf16 matmul rate and checks the targets:

  - paged decode attention, batch 64 x 4k context: >= 70% of the device-to-device copy bandwidth, >= 3x reference
  - extend attention, 4k new tokens: >= 40% of the dense bf16 matmul rate, >= 3x reference

Without a CUDA device only the references run (small shapes, wall-clock median), and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib import import_module

import torch

decode = import_module("engine_core.kernels.decode_attention")
extend = import_module("engine_core.kernels.extend_attention")
norm = import_module("engine_core.kernels.rms_norm")
rope = import_module("engine_core.kernels.rope")
act = import_module("engine_core.kernels.activation")
store = import_module("engine_core.kernels.store_kv")


def _time_ms(fn, cuda: bool) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def _paged(lens, page_size, hk, d, dtype, device):
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages)
    k_cache = torch.randn(total, page_size, hk, d, device=device).to(dtype)
    v_cache = torch.randn(total, page_size, hk, d, device=device).to(dtype)
    order = torch.randperm(total, device=device).to(torch.int32)  # scattered pages, as after churn
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[at : at + n]
        at += n
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


def _entry(kernel, shape, unit, amount, triton_fn, ref_fn, cuda):
    """One result row; `amount` is bytes (unit "GB/s") or FLOPs (unit "TFLOP/s") per call."""
    scale = 1e-9 if unit == "GB/s" else 1e-12
    row = {"kernel": kernel, "shape": shape, "unit": unit}
    for name, fn in (("triton", triton_fn if cuda else None), ("torch", ref_fn)):
        if fn is None:
            continue
        ms = _time_ms(fn, cuda)
        row[f"{name}_ms"] = round(ms, 4)
        row[f"{name}_rate"] = float(f"{amount * scale / (ms * 1e-3):.4g}")
    if "triton_ms" in row:
        row["speedup_vs_torch"] = round(row["torch_ms"] / row["triton_ms"], 2)
    return row


def _decode_rows(cuda, device, dtype, shapes, hq, hk, d):
    rows = []
    for batch, context, page_size in shapes:
        k_cache, v_cache, table, lens = _paged([context] * batch, page_size, hk, d, dtype, device)
        q = torch.randn(batch, hq, d, device=device).to(dtype)
        args = (q, k_cache, v_cache, table, lens, d**-0.5)
        kv_bytes = 2 * batch * context * hk * d * k_cache.element_size()
        shape = f"batch={batch} context={context} page={page_size} hq={hq} hk={hk} d={d} {str(dtype)[6:]}"
        rows.append(_entry("paged_decode_attention", shape, "GB/s", kv_bytes,
                           lambda a=args: decode.paged_decode_attention_triton(*a),
                           lambda a=args: decode.paged_decode_attention_ref(*a), cuda))
    return rows


def _extend_rows(cuda, device, dtype, shapes, hq, hk, d):
    rows = []
    for batch, new, prefix, page_size in shapes:
        k_cache, v_cache, table, _ = _paged([prefix + new] * batch, page_size, hk, d, dtype, device)
        q = torch.randn(batch * new, hq, d, device=device).to(dtype)
        cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
        prefixes = torch.full((batch,), prefix, dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, table, cu, prefixes, d**-0.5)
        # two matmuls (QK^T, PV) of 2 FLOPs per multiply-add over the visible (causal) keys
        visible = batch * (new * prefix + new * (new + 1) // 2)
        flops = 4 * visible * hq * d
        shape = f"batch={batch} new={new} prefix={prefix} page={page_size} hq={hq} hk={hk} d={d} {str(dtype)[6:]}"
        rows.append(_entry("extend_attention", shape, "TFLOP/s", flops,
                           lambda a=args, n=new: extend.extend_attention_triton(*a, max_seqlen_q=n),
                           lambda a=args: extend.extend_attention_ref(*a), cuda))
    return rows


def _elementwise_rows(cuda, device, dtype, tokens, hidden, inter, hq, hk, d):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    res, w = torch.randn_like(x), torch.randn(hidden, device=device).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=device).to(dtype)
    q, k = torch.randn(tokens, hq, d, device=device).to(dtype), torch.randn(tokens, hk, d, device=device).to(dtype)
    cache = rope.build_rope_cache(d, tokens, 500000.0, None, device)
    pos = torch.arange(tokens, device=device)
    kc = torch.empty(tokens // 16, 16, hk, d, device=device, dtype=dtype)
    vc, slots = torch.empty_like(kc), torch.randperm(tokens, device=device)
    e = x.element_size()
    return [
        _entry("fused_add_rms_norm", f"tokens={tokens} hidden={hidden}", "GB/s", 4 * x.numel() * e,
               lambda: norm.fused_add_rms_norm_triton(x, res, w, 1e-6),
               lambda: norm.fused_add_rms_norm_ref(x, res, w, 1e-6), cuda),
        _entry("apply_rope", f"tokens={tokens} hq={hq} hk={hk} d={d}", "GB/s", 2 * (q.numel() + k.numel()) * e,
               lambda: rope.apply_rope_triton(q, k, pos, cache), lambda: rope.apply_rope_ref(q, k, pos, cache), cuda),
        _entry("silu_and_mul", f"tokens={tokens} intermediate={inter}", "GB/s", 3 * tokens * inter * e,
               lambda: act.silu_and_mul_triton(gate_up), lambda: act.silu_and_mul_ref(gate_up), cuda),
        _entry("store_kv", f"tokens={tokens} hk={hk} d={d}", "GB/s", 4 * k.numel() * e,
               lambda: store.store_kv_triton(k, k, kc, vc, slots), lambda: store.store_kv_ref(k, k, kc, vc, slots),
               cuda),
    ]


def device_peaks(device) -> dict:
    """The device's copy bandwidth (bytes read + written) and dense bf16 matmul rate: the ceilings the targets
    and loadtests/sim/calibrate/h200.py measure against."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), True)
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b, True)
    return {"copy_GBps": round(2 * src.numel() / (copy_ms * 1e-3) * 1e-9, 1),
            "bf16_matmul_TFLOPs": round(2 * n**3 / (mm_ms * 1e-3) * 1e-12, 1)}


def _targets(rows, peaks) -> list[dict]:
    def find(kernel, prefix):
        return next(r for r in rows if r["kernel"] == kernel and r["shape"].startswith(prefix))

    dec = find("paged_decode_attention", "batch=64 context=4096 page=16")
    ext = find("extend_attention", "batch=1 new=4096 prefix=0")
    checks = [
        ("decode 64x4k bandwidth >= 70% of copy", dec["triton_rate"], 0.7 * peaks["copy_GBps"]),
        ("decode 64x4k >= 3x torch reference", dec["speedup_vs_torch"], 3.0),
        ("extend 4k FLOP rate >= 40% of bf16 matmul", ext["triton_rate"], 0.4 * peaks["bf16_matmul_TFLOPs"]),
        ("extend 4k >= 3x torch reference", ext["speedup_vs_torch"], 3.0),
    ]
    return [{"target": name, "value": v, "threshold": round(t, 2), "pass": v >= t} for name, v, t in checks]


def run(cpu_only: bool = False) -> dict:
    """The report as a dict; `cpu_only` runs the small CPU reference shapes even when a GPU is present."""
    cuda = torch.cuda.is_available() and not cpu_only
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    if cuda:
        dtype, hq, hk, d = torch.bfloat16, 32, 8, 128
        decode_shapes = [(64, 4096, 16), (64, 4096, 1), (1, 32768, 16), (256, 1024, 16), (16, 8192, 16)]
        extend_shapes = [(1, 4096, 0, 16), (1, 2048, 2048, 16), (8, 512, 1024, 16)]
        elementwise = (4096, 4096, 14336)
    else:
        # small shapes: the CPU run only shows the references work and roughly what they cost
        dtype, hq, hk, d = torch.float32, 8, 2, 64
        decode_shapes = [(8, 512, 16), (1, 2048, 16)]
        extend_shapes = [(1, 256, 0, 16), (2, 128, 256, 16)]
        elementwise = (256, 1024, 2048)
    rows = _decode_rows(cuda, device, dtype, decode_shapes, hq, hk, d)
    rows += _extend_rows(cuda, device, dtype, extend_shapes, hq, hk, d)
    rows += _elementwise_rows(cuda, device, dtype, *elementwise, hq, hk, d)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "triton": "run (triton.testing.do_bench)" if cuda else "not run: no CUDA device",
              "torch": torch.__version__, "results": rows}
    if cuda:
        import triton

        report["triton_version"] = triton.__version__
        report["peaks"] = device_peaks(device)
        report["targets"] = _targets(rows, report["peaks"])
    else:
        report["targets"] = "not checked: no CUDA device (targets are for an H200)"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_core.kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    args = parser.parse_args(argv)
    report = run()
    # pass/fail lines go to stderr in --json mode so stdout stays one JSON document
    human = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"device: {report['device']}   triton: {report['triton']}", file=human)
        for r in report["results"]:
            t = f"triton {r['triton_ms']:.3f} ms {r['triton_rate']} {r['unit']}  " if "triton_ms" in r else ""
            print(f"{r['kernel']:24} {r['shape']:58} {t}torch {r['torch_ms']:.3f} ms {r['torch_rate']} {r['unit']}",
                  file=human)
    if isinstance(report["targets"], list):
        for t in report["targets"]:
            print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['value']} (need {t['threshold']})", file=human)
    else:
        print(f"targets: {report['targets']}", file=human)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
