"""How many CPU threads torch uses in one engine worker, chosen once at its start.

Torch's default is every core of the machine, in every process. Several workers on one machine (`duet up`, the
benchmark stacks) then run more busy threads than there are cores, and an OpenMP parallel region waits at its
barrier for a thread the kernel has descheduled: on a loaded 2-core machine a 1 ms matmul took 20 ms that way.
So each worker gets a share: `--threads N` when given (duet up passes cores / workers), else OMP_NUM_THREADS
when set (the benchmark stacks set it), else every core this process may run on. Inter-op threads are 1: the
model runs one op at a time, and idle inter-op workers only add threads to spin.

A worker loads its model on one thread and steps on another, and libgomp (torch's OpenMP) keeps a team of worker
threads for every thread that ever ran a parallel region. With the loader's team left behind, it manages more
threads than there are cores, and then it stops spinning its idle workers between parallel regions and parks
them at once: every region then waits for a wake-up, and a decode step of SmolLM2 at batch 16 took 109 ms
against 82 ms (docs/benchmarks.md). `release_openmp_team()`, called on the loading thread when it is done,
frees that team.
"""

from __future__ import annotations

import ctypes
import os

import torch

_OMP_PAUSE_HARD = 2  # omp_pause_resource_kind: free the threads (soft keeps them)


def default_threads(environ=os.environ) -> int:
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp)
    return len(os.sched_getaffinity(0))


def configure_torch_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads (`num_threads`, or default_threads()) and one inter-op thread; returns the
    intra-op count. Call before the model runs its first op (inter-op threads cannot change after that)."""
    n = default_threads() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"--threads must be at least 1, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already fixed: some op ran in parallel before this call (in-process tests)
        pass
    return n


def release_openmp_team() -> bool:
    """Free the OpenMP worker threads that this thread's parallel regions started, if torch runs on libgomp
    (OpenMP 5's omp_pause_resource_all; the next parallel region on this thread would start a team again).
    Returns whether a team was released: False where torch uses another OpenMP runtime or none."""
    try:  # the copy torch loaded, matched by its soname; never a second one
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    return pause(_OMP_PAUSE_HARD) == 0
