"""A worker's torch threads: its --threads share, else OMP_NUM_THREADS, else its cores; one inter-op thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_core.threads import configure_torch_threads, default_threads


def test_default_follows_omp_num_threads_else_the_cores_this_process_may_use():
    assert default_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert default_threads({}) == len(os.sched_getaffinity(0))
    assert default_threads({"OMP_NUM_THREADS": "lots"}) == len(os.sched_getaffinity(0))


def test_a_fresh_worker_process_gets_its_threads_and_one_interop_thread():
    code = ("from engine_core.threads import configure_torch_threads; import torch; "
            "configure_torch_threads(1); print(torch.get_num_threads(), torch.get_num_interop_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.stdout.split() == ["1", "1"]


def test_zero_threads_is_a_clear_error():
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        configure_torch_threads(0)


def test_a_loading_thread_hands_back_its_openmp_team():
    """A thread that ran a parallel region keeps libgomp worker threads alive; release_openmp_team frees them, so
    the step loop's team is the only one (two teams on two cores made every decode step 30% slower)."""
    code = """
import os, threading, torch
from engine_core.threads import release_openmp_team
torch.set_num_threads(2)
def tasks(): return len(os.listdir("/proc/self/task"))
seen = {}
def load():
    before = tasks()
    x = torch.randn(256, 256)
    for _ in range(20): x = torch.tanh(x @ x)  # parallel regions: libgomp starts this thread's team
    seen["with_team"] = tasks() - before
    seen["released"] = release_openmp_team()
    seen["after"] = tasks() - before
t = threading.Thread(target=load); t.start(); t.join()
print(seen["with_team"], seen["released"], seen["after"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    with_team, released, after = out.stdout.split()
    assert released == "True" and int(with_team) >= 1  # torch on libgomp, as the CPU wheel ships it
    assert int(after) == 0
