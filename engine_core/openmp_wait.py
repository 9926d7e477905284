"""How long an idle OpenMP thread of a worker spins before it sleeps: set once, before torch loads libgomp.

    default_spin(environ=os.environ) -> str | None   # what is set: None when the operator chose already

Why: torch's libgomp keeps a thread that finishes its share of a parallel region spinning for the next one,
GOMP_SPINCOUNT times (300,000 by default) before it sleeps. A decode step runs hundreds of parallel regions
(every matmul, every compiled elementwise loop, the attention kernels). On a machine whose cores other
processes also want, a thread that waits at a region's end spins through its time slice while the thread it
waits for is descheduled, and the step stretches by whole scheduler slices. Measured on the 2-core Xeon under
load average 10 (other sessions' benchmarks; SmolLM2-135M bf16, a decode step of 16 sequences x ~600 context,
2 torch threads, in-process): 3.2-4.2 s wall and 1.4-2.2 s CPU a step at the default, 0.09-0.23 s wall and
0.09-0.11 s CPU at GOMP_SPINCOUNT=1000, 0.12-0.21 s at 3000, 0.27-0.47 s at 10000, 0.9-1.3 s at 30000; one
thread took 0.18-0.21 s. That is what made the served bf16 figures of docs/benchmarks.md fall to a fraction of
the steps measured alone (engine_paged's unique load at 34 tok/s), and it hits every 2-thread worker on a
shared machine, whichever engine.

So a worker's idle threads spin DEFAULT_SPINCOUNT times and then sleep: 75-110 us on this Xeon (3000 spins of
libgomp's loop, a load and a `pause`, took 22-33 us of CPU), meant to outlast the gaps between a step's
back-to-back regions (tens of microseconds of Python between them, an estimate), so that a quiet machine keeps
its threads awake through a step (the shortest spins, 1000, cost a served fp32 decode step 82 -> 109 ms when
libgomp chose them itself for too many threads, engine_core/threads.py), while under load the spinning stops
30x sooner than at the default. The operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins
(GOMP_SPINCOUNT=300000 restores libgomp's default). It applies where torch runs on libgomp (Linux wheels);
another OpenMP runtime ignores the variable. libgomp reads its environment once, when it is loaded, so this
runs first thing in a worker (duet/cli.py `duet engine`, before anything imports torch); after that it is too
late, and this says so in the log.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

SPIN_ENV = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_SPINCOUNT = "10000"


def default_spin(environ=os.environ) -> str | None:
    """Set GOMP_SPINCOUNT to DEFAULT_SPINCOUNT in `environ` unless the operator set it or OMP_WAIT_POLICY;
    returns the value set, or None when nothing was."""
    if environ.get(SPIN_ENV, "").strip() or environ.get(WAIT_POLICY_ENV, "").strip():
        return None
    if environ is os.environ and "torch" in sys.modules:
        log.warning("%s: torch is loaded already, its OpenMP runtime keeps its spin count", SPIN_ENV)
    environ[SPIN_ENV] = DEFAULT_SPINCOUNT
    return DEFAULT_SPINCOUNT
