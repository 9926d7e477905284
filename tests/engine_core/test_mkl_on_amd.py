"""MKL dispatches by CPU features on an AMD CPU once a worker's start unlocks it before torch loads
(engine_core/mkl_on_amd.py; importing engine_core alone does not: tests/engine_core/test_import_does_no_io.py).

MKL's own view is read through its exported service function `mkl_serv_get_cpu_type()`: 0 is its generic code
path, what it runs on an AMD CPU by default; a positive value is an instruction-set path (AVX2, AVX-512)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core import mkl_on_amd

ROOT = Path(__file__).resolve().parents[2]
ON_AMD = sys.platform == "linux" and mkl_on_amd.cpu_vendor() == "AuthenticAMD"
amd_only = pytest.mark.skipif(not ON_AMD, reason="MKL's vendor check changes nothing on a non-AMD CPU")

_PROBE = """
import ctypes, json, os, sys
{first}
import torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
g = torch.Generator().manual_seed(0)
w, x = torch.randn(3072, 576, generator=g), torch.randn(512, 576, generator=g)
error = (torch.nn.functional.linear(x, w).double() - x.double() @ w.double().t()).abs().max().item()
print(json.dumps({{"status": sys.modules["engine_core.mkl_on_amd"].STATUS, "cpu_type": lib.mkl_serv_get_cpu_type(),
                  "gemm_error": error}}))
"""


WORKER_START = "from engine_core.mkl_on_amd import unlock_mkl_on_amd; unlock_mkl_on_amd()"  # as duet/cli.py does


def _probe(first: str = WORKER_START, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_a_worker_process_gets_the_feature_path_and_the_switch_keeps_the_vendor_check(tmp_path):
    on, off = _probe(DUET_CACHE_DIR=str(tmp_path)), _probe(DUET_MKL_ON_AMD="0")
    assert "DUET_MKL_ON_AMD=0" in off["status"]
    if ON_AMD:
        assert on["status"].startswith("MKL dispatches by CPU features on this AMD CPU"), on["status"]
        assert on["cpu_type"] > 0 and off["cpu_type"] == 0
        assert list((tmp_path / "mkl-on-amd").rglob("*.so")), "the shim is built into the cache dir"
    else:
        assert "not an AMD" in on["status"] and on["cpu_type"] == off["cpu_type"]
    # either path computes the same product: 576-long fp32 dot products (values up to ~100) within float rounding
    # of float64's (8e-5 and 5e-5 measured on a Zen 5); a wrong kernel would be off by whole units
    assert on["gemm_error"] < 1e-3 and off["gemm_error"] < 1e-3


@amd_only
def test_the_parity_references_in_this_process_run_the_workers_mkl_path():
    import ctypes

    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    assert mkl_on_amd.STATUS.startswith("MKL dispatches by CPU features"), mkl_on_amd.STATUS
    assert lib.mkl_serv_get_cpu_type() > 0


@amd_only
def test_too_late_or_no_compiler_says_why_and_changes_nothing(tmp_path):
    late = _probe(first="import torch; " + WORKER_START)
    assert "torch was imported before engine_core" in late["status"] and late["cpu_type"] == 0
    bare = _probe(CC=str(tmp_path / "no-such-cc"), DUET_CACHE_DIR=str(tmp_path))
    assert "no C compiler" in bare["status"] and bare["cpu_type"] == 0
    # a cache dir it cannot write (a file stands where the dir should be): the worker still starts, as shipped
    (tmp_path / "blocked").write_text("")
    blocked = _probe(DUET_CACHE_DIR=str(tmp_path / "blocked"))
    assert "could not be built or loaded" in blocked["status"] and blocked["cpu_type"] == 0
