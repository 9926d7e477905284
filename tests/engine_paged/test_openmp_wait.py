"""A paged worker's OpenMP threads stop spinning soon after a parallel region (engine_core/openmp_wait.py): at
libgomp's default spin count a 2-thread bf16 decode step on a shared 2-core machine took 15-40x as long as with
short spins, which is what made engine_paged's served bf16 figures collapse. Read from the real worker process:
libgomp prints the spin count it took (OMP_DISPLAY_ENV=VERBOSE) when torch loads it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from duet.launcher import free_port
from engine_core.openmp_wait import DEFAULT_SPINCOUNT, default_spin


def _worker_openmp_env(checkpoint, **env) -> dict[str, str]:
    """What libgomp in a `duet engine paged` process says it runs with; the worker is stopped once it has said it."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "engine", "paged", "--model", str(checkpoint),
                             "--port", str(free_port()), "--device", "cpu", "--kv-cache-tokens", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(base, OMP_DISPLAY_ENV="VERBOSE", **env))
    seen: dict[str, str] = {}
    watchdog = threading.Timer(120, proc.kill)  # a runtime that prints nothing must not hang the test
    watchdog.start()
    try:
        for line in proc.stderr:
            if "OPENMP DISPLAY ENVIRONMENT END" in line:
                break
            name, eq, value = line.strip().partition(" = ")
            if eq:
                seen[name] = value.strip("'")
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(30)
    return seen


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torch runs on libgomp in its Linux wheels only")


@linux_only
def test_a_paged_worker_runs_with_short_openmp_spins(tiny_checkpoint):
    seen = _worker_openmp_env(tiny_checkpoint)
    assert seen.get("GOMP_SPINCOUNT") == DEFAULT_SPINCOUNT, seen


@linux_only
def test_the_operators_spin_count_wins(tiny_checkpoint):
    assert _worker_openmp_env(tiny_checkpoint, GOMP_SPINCOUNT="300000").get("GOMP_SPINCOUNT") == "300000"


def test_a_wait_policy_of_the_operators_own_is_left_alone():
    env = {"OMP_WAIT_POLICY": "active"}
    assert default_spin(env) is None and env == {"OMP_WAIT_POLICY": "active"}
    env = {}
    assert default_spin(env) == DEFAULT_SPINCOUNT and env == {"GOMP_SPINCOUNT": DEFAULT_SPINCOUNT}
