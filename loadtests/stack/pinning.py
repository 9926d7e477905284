"""Physical isolation for `duet bench compare --pin-cores`: one engine worker per core.

Without pinning, four single-thread workers share two cores and the scheduler moves them at will: sending
documents to one worker and sessions to another buys no compute, because both land on the same cores.
Pinned, worker i runs only on core i (taskset, duet/launcher.py's `WorkerSpec.cpus`), so a document's
prefill on one core never delays a session turn on the other - the isolation a fleet of separate machines
has. On a two-core machine that means two workers per stack (all_paged 2 paged, all_prefix 2 prefix,
duet 1 + 1); the gateway and the load client stay unpinned (there is no third core for them; they are light).

    usable_cores() -> list[int]                 the cores this process may run on (sched_getaffinity)
    core_plan(workers, cores=None) -> list[str]  one core per worker, in order; PinError when too few
    pinned_stack(model, kinds, limits, trace_dir)  a ServingStack whose running workers are each moved onto
                                                 a core of their own (every thread, as `taskset -a -p`)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


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


def _pin(pid: int, core: int) -> None:
    """Every thread of the worker (its step loop and gRPC threads exist by now) onto one core, as `taskset -a -p`."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), {core})
        except ProcessLookupError:
            pass  # a thread that just ended


@contextmanager
def pinned_stack(model: Path, kinds: tuple[str, ...], limits, trace_dir: Path | None = None,
                 gateway_extra: dict | None = None):
    """(stack, model dir): a ServingStack of `kinds` with each worker pinned to its own core once running
    (`duet bench fleet --validate` and its calibrations); with `trace_dir`, each worker writes its step trace
    there (DUET_STEP_TRACE, engine_core/step_trace.py); `gateway_extra`: more gateway config keys (its router)."""
    from engine_core.step_trace import STEP_TRACE_ENV
    from loadtests.stack.serving import NO_DRAFTING, ServingStack

    cores = usable_cores()
    before = os.environ.get(STEP_TRACE_ENV)
    if trace_dir is not None:
        os.environ[STEP_TRACE_ENV] = str(trace_dir)  # the workers inherit it; the gateway ignores it
    try:
        # the simulator does not model drafting, so the local prefix worker does not draft either
        with ServingStack(model, list(kinds), {}, limits, worker_args=NO_DRAFTING,
                          gateway_extra=gateway_extra) as stack:
            for i, (worker_id, _, _) in enumerate(stack.slots):
                pid = stack.supervisor.pid(worker_id)
                if pid is not None and len(cores) >= len(kinds):
                    _pin(pid, cores[i % len(cores)])
            yield stack, model
    finally:
        if before is None:
            os.environ.pop(STEP_TRACE_ENV, None)
        else:
            os.environ[STEP_TRACE_ENV] = before
