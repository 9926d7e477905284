"""Physical isolation for `duet bench compare --pin-cores`: one engine worker per core.

Without pinning, four single-thread workers share two cores and the scheduler moves them at will: sending
documents to one worker and sessions to another buys no compute, because both land on the same cores.
Pinned, worker i runs only on core i (taskset, duet/launcher.py's `WorkerSpec.cpus`), so a document's
prefill on one core never delays a session turn on the other - the isolation a fleet of separate machines
has. On a two-core machine that means two workers per stack (all_paged 2 paged, all_prefix 2 prefix,
duet 1 + 1); the gateway and the load client stay unpinned (there is no third core for them; they are light).

    usable_cores() -> list[int]                 the cores this process may run on (sched_getaffinity)
    core_plan(workers, cores=None) -> list[str]  one core per worker, in order; PinError when too few
"""

from __future__ import annotations

import os


class PinError(ValueError):
    """More workers than cores to pin them to (the message says how many of each)."""


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def core_plan(workers: int, cores: list[int] | None = None) -> list[str]:
    """Worker i -> core cores[i], as taskset core lists."""
    cores = usable_cores() if cores is None else list(cores)
    if workers > len(cores):
        raise PinError(f"--pin-cores puts one worker on each core: {workers} workers, but only {len(cores)} "
                       f"usable cores ({','.join(map(str, cores))}); use --workers {len(cores)} or fewer")
    return [str(c) for c in cores[:workers]]
