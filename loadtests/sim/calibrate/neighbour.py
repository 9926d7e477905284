"""`duet bench fleet-calibrate --neighbour`: how much slower a model step runs while the other core runs one too,
stored as `neighbour_slowdown` in the cpu fit (fleet-calibrate's --out, else this machine's own: sim/fleet/cpu_fit.py).

The step fit (steps.py) times one runner with the rest of the machine idle, but the local stack --validate
runs pins a worker to each core, and two busy cores share the last-level cache and the memory bandwidth. Here
the runner is pinned to one core and timed at a prefill and a decode shape, alternately alone and with a second
process (the same model, pinned to the other core) stepping a prefill in a loop. The figure is the median ratio
of the step's *thread CPU time* with and without the neighbour, minus one: CPU time, not wall time, so that other
processes sharing the core (a loaded machine) stretch both alike instead of counting as contention. The fleet
simulator applies it to a step that starts while another worker is mid-step (`SimSettings.neighbour_slowdown`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = ([(256, 0)], [(1, 1024)] * 16)  # a prefill chunk, a decode batch


def _runner():
    from engine_core.mkl_on_amd import unlock_mkl_on_amd

    unlock_mkl_on_amd()  # before torch loads: the MKL path a worker runs (engine_core/mkl_on_amd.py)

    import torch

    from duet.model_dir import read_model_dir
    from engine_core.builder import build_runtime
    from loadtests.sim.fleet.cpu_fit import fit_path, stack_dtype
    from loadtests.stack.serving import preset_checkpoint

    torch.set_num_threads(1)
    model_dir = read_model_dir(str(preset_checkpoint("smollm2")))
    # the dtype the fit timed (its file is the one this process reads: fleet-calibrate's --out, passed on in the
    # environment to the neighbour process too)
    dtype = stack_dtype(json.loads(fit_path().read_text()), model_dir.config.dtype)
    return (build_runtime(model_dir, device="cpu", page_size=16, num_pages=1200, dtype=dtype),
            model_dir.config.vocab_size)


def _neighbour(core: int, seconds: float) -> None:
    """The neighbour: prefill steps on `core` for `seconds`."""
    from loadtests.sim.calibrate.steps import _chunks

    os.sched_setaffinity(0, {core})
    rt, vocab = _runner()
    chunks = _chunks(SHAPES[0], 16, vocab)
    end = time.time() + seconds
    while time.time() < end:
        rt.runner.forward(chunks)


def measure_neighbour(repeats: int = 3, out: Path | None = None, progress=None) -> dict:
    from loadtests.sim.fleet.cpu_fit import fit_path

    out = Path(out) if out is not None else fit_path()
    from loadtests.sim.calibrate.steps import _chunks

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError("--neighbour needs two cores (one for the runner, one for its neighbour)")
    os.sched_setaffinity(0, {cores[1]})
    rt, vocab = _runner()
    steps = [_chunks(shape, 16, vocab) for shape in SHAPES]

    def cpu_s(chunks) -> float:
        times = []
        for _ in range(3):
            t0 = time.thread_time()
            rt.runner.forward(chunks)
            times.append(time.thread_time() - t0)
        return statistics.median(times)

    for chunks in steps:
        rt.runner.forward(chunks)  # warm-up
    ratios = []
    for i in range(repeats):
        alone = [cpu_s(c) for c in steps]
        neighbour = subprocess.Popen([sys.executable, "-m", "loadtests.sim.calibrate.neighbour", str(cores[0]), "15"],
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            time.sleep(4.0)  # its model loaded and stepping
            busy = [cpu_s(c) for c in steps]
        finally:
            neighbour.kill()
            neighbour.wait()
        ratios += [b / a for a, b in zip(alone, busy)]
        if progress:
            progress(f"repeat {i + 1}/{repeats}: CPU time with the neighbour busy / alone = "
                     f"{', '.join(f'{b / a:.3f}' for a, b in zip(alone, busy))}")
    slowdown = max(0.0, statistics.median(ratios) - 1.0)
    fit = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    fit["neighbour_slowdown"] = round(slowdown, 4)
    fit["neighbour_slowdown_how"] = (f"duet bench fleet-calibrate --neighbour (loadtests/sim/calibrate/neighbour.py): "
                                     f"median of {len(ratios)} CPU-time ratios, "
                                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    Path(out).write_text(json.dumps(fit, indent=1) + "\n")
    return {"neighbour_slowdown": fit["neighbour_slowdown"], "ratios": [round(r, 4) for r in ratios]}


if __name__ == "__main__":  # the neighbour process: CORE SECONDS
    _neighbour(int(sys.argv[1]), float(sys.argv[2]))
