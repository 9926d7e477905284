"""How many CPU threads torch uses in one engine worker, chosen once at its start.

Torch's default is every core of the machine, in every process. Several workers on one machine (`duet up`, the
benchmark stacks) then run more busy threads than there are cores, and an OpenMP parallel region waits at its
barrier for a thread the kernel has descheduled: on a loaded 2-core machine a 1 ms matmul took 20 ms that way.
So each worker gets a share: `--threads N` when given (duet up passes cores / workers), else OMP_NUM_THREADS
when set (the benchmark stacks set it), else every core this process may run on. Inter-op threads are 1: the
model runs one op at a time, and idle inter-op workers only add threads to spin.
"""

from __future__ import annotations

import os

import torch


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
