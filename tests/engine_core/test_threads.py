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
