"""`duet bench fleet-calibrate`: measure the real ModelRunner's step times on this machine and fit the `cpu`
cost model (loadtests/sim/fleet/cost_models.LinearCostModel) to them, written to this machine's fit in the user
cache (loadtests/sim/fleet/cpu_fit.machine_fit_path; `--out` elsewhere, e.g. the repository's default
loadtests/sim/fleet/cpu_cost.json).

The model is the checkpoint the local stack runs (default: `duet bench compare`'s random checkpoint of
SmolLM2-135M's shape, with `--threads 1` as each of its workers), in the dtype `duet up` computes in here
(`--dtype auto`: bf16 on a CPU with AMX or AVX512_BF16, duet/auto_dtype.py) unless `--dtype` names one. The fit
records the CPU (vendor, family, model, the flags that change a step's cost), the dtype and the threads it timed
(cpu_fit.fit_record): `--validate` starts its stack at that dtype and thread count, and advise says when the fit
describes another machine (cpu_fit.fit_report). Shapes: prefill chunks of 16..2048 tokens
after 0..3072 cached ones, decode batches of 1..64 sequences at 64..3072 tokens of context, and mixed steps
(a prefill chunk plus a decode batch), the kinds of step both schedulers make. Each shape runs `repeats`
times after a warm-up; the median is kept. The fit is least squares over (1, prefill tokens, decode
tokens, attended pairs, logits rows, decode context tokens) on relative error, negative coefficients dropped and the rest refitted; the
JSON records the model, CPU, dtype, threads, torch version, every measured point and the fit's relative error.
"""

from __future__ import annotations

from engine_core.mkl_on_amd import unlock_mkl_on_amd

unlock_mkl_on_amd()  # before torch loads: the fit times the MKL path a worker runs (engine_core/mkl_on_amd.py)

import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine_core.forward_batch import SeqChunk
from loadtests.sim.fleet.cost_models import LinearCostModel, StepShape, shape_of
from loadtests.sim.fleet.cpu_fit import fit_record

FEATURES = ("intercept_s", "per_prefill_token_s", "per_decode_token_s", "per_attended_pair_s", "per_row_s",
            "per_decode_context_token_s")


MEASURED_ELSEWHERE = ("gateway", "neighbour_slowdown", "neighbour_slowdown_how", "in_situ")  # calibrate_gateway.py,
# calibrate_neighbour.py, calibrate_in_situ.py


def _shapes() -> list[list[tuple[int, int]]]:
    """Each step as (new tokens, cached tokens before them) per chunk."""
    out: list[list[tuple[int, int]]] = []
    for n in (16, 128, 512, 1024, 2048):
        for start in (0, 1024, 3072):
            out.append([(n, start)])
    for batch in (1, 4, 16, 32, 64):
        for context in (64, 1024, 3072):
            out.append([(1, context)] * batch)
    for n, batch in ((256, 16), (1024, 32), (512, 64)):
        out.append([(n, 512)] + [(1, 1024)] * batch)
    return out


def quick_shapes() -> list[list[tuple[int, int]]]:
    """`--quick`: the corners of _shapes() (shortest and longest chunks and batches, at no and the most context)
    and two mixed steps, 14 shapes of 33, for a machine that cannot spare the full calibration."""
    return ([[(n, start)] for n in (16, 512, 2048) for start in (0, 3072)]
            + [[(1, context)] * batch for batch in (1, 16, 64) for context in (64, 3072)]
            + [[(n, 512)] + [(1, 1024)] * batch for n, batch in ((256, 16), (512, 64))])


def _chunks(step: list[tuple[int, int]], page_size: int, vocab: int) -> list[SeqChunk]:
    chunks, next_page = [], 0
    for n, start in step:
        pages = -(-(start + n) // page_size)
        chunks.append(SeqChunk([i % (vocab - 1) + 1 for i in range(n)], start, list(range(next_page, next_page + pages))))
        next_page += pages
    return chunks


def _features(s: StepShape) -> list[float]:
    return [1.0, s.prefill_tokens, s.decode_tokens, s.attended_pairs, s.rows, s.decode_context_tokens]


def fit(points: list[tuple[StepShape, float]]) -> dict[str, float]:
    """Least squares on relative error (each row divided by its time: a 5 ms decode step counts as much as a
    2 s prefill), with non-negative coefficients (a negative one is dropped and the rest refitted)."""
    y = np.array([t for _, t in points])
    x = np.array([_features(s) for s, _ in points]) / y[:, None]
    y = np.ones_like(y)
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0]
    full = dict.fromkeys(FEATURES, 0.0)
    for k, c in zip(keep, coef):
        full[FEATURES[k]] = float(c)
    return full


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def measure(model: str | None = None, threads: int = 1, repeats: int = 3, out: Path | None = None, progress=None,
            dtype: str = "auto", shapes: list | None = None, clock: str = "wall") -> dict:
    """The fit, written to `out` (default: this machine's fit in the user cache); `dtype` as a worker's --dtype
    (auto: what `duet up` computes in here); `shapes`: a subset of _shapes() (a shorter calibration); `clock`:
    wall time, or with one thread the calling thread's CPU time ("thread": on a machine other processes load,
    the step without the time it waited for a core, i.e. about what a quiet machine's wall clock reads)."""
    if clock not in CLOCKS or (clock == "thread" and threads != 1):
        raise ValueError(f"--clock {clock!r}: wall, or thread with --threads 1 (other threads' CPU time is not "
                         f"the calling thread's)")
    now = CLOCKS[clock]
    from duet.auto_dtype import resolve_dtype
    from duet.model_dir import read_model_dir
    from engine_core.builder import build_runtime
    from loadtests.sim.fleet.cpu_fit import machine_fit_path
    from loadtests.stack.serving import preset_checkpoint

    out = Path(out) if out is not None else machine_fit_path()
    torch.set_num_threads(threads)
    model_dir = read_model_dir(str(model) if model else str(preset_checkpoint("smollm2")))
    computes = resolve_dtype(dtype, "cpu") or model_dir.config.dtype  # a worker's --dtype, resolved as it does
    page_size = 16
    steps = shapes or _shapes()
    pages = max(sum(-(-(s + n) // page_size) for n, s in step) for step in steps)
    rt = build_runtime(model_dir, device="cpu", page_size=page_size, num_pages=pages, dtype=computes)
    points = []
    for step in steps:
        chunks = _chunks(step, page_size, model_dir.config.vocab_size)
        rt.runner.forward(chunks)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = now()
            rt.runner.forward(chunks)
            times.append(now() - t0)
        points.append((shape_of(chunks), statistics.median(times)))
        if progress:
            progress(f"{len(chunks)} chunks, {points[-1][0]}: {points[-1][1] * 1000:.1f} ms")
    coefficients = fit(points)
    model_fit = LinearCostModel("cpu", **coefficients)
    errors = [abs(model_fit.step_seconds(s) - t) / t for s, t in points]
    result = {
        "how": "duet bench fleet-calibrate (loadtests/sim/calibrate/steps.py): the real ModelRunner, median of "
               f"{repeats} runs per step shape after a warm-up, {len(steps)} shapes"
               + (" (a subset: --quick)" if shapes else "")
               + (", thread CPU time (--clock thread: the machine was shared)" if clock == "thread" else ""),
        "clock": clock,
        "model": model_dir.path.name if hasattr(model_dir.path, "name") else str(model_dir.path),
        **fit_record(computes, threads), "dtype_requested": dtype, "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "coefficients": coefficients,
        "fit_relative_error": {"mean": round(statistics.fmean(errors), 4), "max": round(max(errors), 4)},
        "points": [{"prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens,
                    "attended_pairs": s.attended_pairs, "rows": s.rows, "decode_context_tokens": s.decode_context_tokens,
                    "context_tokens": s.context_tokens, "seconds": round(t, 6)} for s, t in points],
    }
    # the file's other sections (`gateway`, `neighbour_slowdown`) are measured by their own commands: keep them
    kept = json.loads(out.read_text()) if out.is_file() else {}
    if kept.get("cpu") != result["cpu"] or kept.get("dtype") != result["dtype"]:
        kept = {}  # those sections measured another machine or dtype: they would not describe this fit's steps
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**{k: v for k, v in kept.items() if k in MEASURED_ELSEWHERE}, **result},
                                    indent=1) + "\n")
    result["out"] = str(out)
    return result
