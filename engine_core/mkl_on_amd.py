"""MKL's fast kernels on AMD CPUs: MKL picks its code path by CPU vendor, and this makes it pick by CPU features.

    unlock_mkl_on_amd() -> str   # what was done, one line (STATUS keeps it for the worker's start-up log)
    run_unlocked(call, *more)    # a spawned process's target: the unlock, then the call (a tensor-parallel rank)

Why: torch's CPU wheel links Intel's MKL, whose SGEMM serves every F.linear the engine runs on its plain weights
(prefill, single-row decode, inductor's extern matmuls). MKL runs its AVX2 / AVX-512 kernels only where an
internal check, `mkl_serv_intel_cpu_true()`, says the CPU is Intel's; on an AMD EPYC it takes a generic path
whatever the CPU supports. On a Zen 5 EPYC (AVX-512) that made a 512-row gate_up matmul take 11.0 ms instead of
4.8 (loadtests/profiles/matmul_bench.py) and a 2,048-token prefill step 2.52 s instead of 1.26 s
(loadtests/profiles/profile_step.py; docs/benchmarks.md).

How: libtorch_cpu exports that function and calls it through its symbol table, so a definition found earlier in
the process's global symbol scope wins. A one-line C library that returns 1 is built once into Duet's cache dir
with the system C compiler and loaded with RTLD_GLOBAL *before torch is imported*: a worker's start does it first
thing (duet/cli.py `duet engine`, and each tensor-parallel rank through `run_unlocked`), as does the first use of
`engine_core.LLM`; importing engine_core does not (no I/O at import). After torch is loaded it is too late, and
this says so. MKL then dispatches on the
CPU's feature bits, as it does on Intel: an AVX2 CPU gets AVX2 kernels, an AVX-512 one AVX-512, never
instructions the CPU lacks. vLLM's CPU backend needs none of this for its linears (oneDNN, which dispatches by
features); Duet keeps MKL for prefill because the real-model parity tier's 1e-4 bound holds there (cpu_linear.py).

Applies on x86-64 Linux with an AMD CPU only; an Intel CPU's check already says yes. DUET_MKL_ON_AMD=0 keeps
MKL's vendor check; no C compiler keeps it too, with the reason in STATUS. The reference side of the parity tests
(transformers, in the test process) gets the same MKL path (tests/conftest.py calls unlock_mkl_on_amd first), as it
would on an Intel CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import platform
import shutil
import subprocess
import sys
from pathlib import Path

_SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
_NAME = "libmkl_on_amd.so"
STATUS = "not tried"


def cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _library() -> Path | None:
    """The shim library, built once per source and compiler into Duet's cache dir (None: no C compiler)."""
    from duet.cache_dir import build_once, cache_root

    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None

    def build(tmp: Path) -> None:
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-x", "c", "-", "-o", str(tmp / _NAME)],
                       input=_SOURCE, text=True, check=True, capture_output=True, timeout=60)

    key = hashlib.sha256(f"{_SOURCE}{compiler}".encode()).hexdigest()[:16]
    return build_once(cache_root() / "mkl-on-amd" / key, build, marker=_NAME) / _NAME


def unlock_mkl_on_amd() -> str:
    """Load the shim if it applies (once per process); returns and keeps in STATUS what was done."""
    global STATUS
    if STATUS != "not tried":
        return STATUS
    if os.environ.get("DUET_MKL_ON_AMD", "1") == "0":
        STATUS = "MKL keeps its vendor check (DUET_MKL_ON_AMD=0)"
    elif sys.platform != "linux" or platform.machine() != "x86_64" or cpu_vendor() != "AuthenticAMD":
        STATUS = "MKL dispatches by CPU features already (not an AMD x86-64 CPU)"
    elif "torch" in sys.modules:
        STATUS = "MKL keeps its vendor check: torch was imported before engine_core unlocked it"
    else:
        try:  # a failure here costs MKL's speed, never the worker: it starts with MKL as shipped
            library = _library()
            if library is None:
                STATUS = "MKL keeps its vendor check: no C compiler to build its shim"
            else:
                ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
                STATUS = "MKL dispatches by CPU features on this AMD CPU (DUET_MKL_ON_AMD=0 keeps its vendor check)"
        except (OSError, subprocess.SubprocessError) as exc:  # no cache dir, a failed build, a noexec mount
            STATUS = f"MKL keeps its vendor check: its shim could not be built or loaded ({exc})"
    return STATUS


def run_unlocked(call: bytes, *more) -> None:
    """The target of a spawned process that runs torch: the unlock, then `function(arg, *more)` from
    `call` = pickle.dumps((function, arg)). The call travels pickled because unpickling it imports its module
    (and torch), which must come after the unlock; `more` is what only multiprocessing can send (a Pipe's end)."""
    unlock_mkl_on_amd()
    function, arg = pickle.loads(call)
    function(arg, *more)
