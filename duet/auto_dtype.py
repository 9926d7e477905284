"""The dtype a worker computes in: `--dtype auto` (the default) picks bf16 on a CPU that multiplies bf16 natively.

    resolve_dtype(requested, device="cpu") -> "float32" | "bfloat16" | None   # None: the directory's own dtype
    describe(requested, resolved) -> str                                      # the line printed at start

bf16 halves the bytes of every weight and KV value a step reads, and on a CPU with AMX (Intel Sapphire Rapids and
later) or AVX512_BF16 (Intel Cooper Lake, AMD Zen 4 and later) oneDNN multiplies it at several times fp32's rate
(engine_core/cpu_linear.py); its perplexity stays within 1% of fp32's (tests/realmodel/test_real_bf16.py). Other
CPUs convert bf16 in software, slower than fp32, so auto picks fp32 there. The flags come from /proc/cpuinfo,
torch-free, so `duet up` says the choice before any worker imports torch. On CUDA auto keeps the model directory's
own dtype. DUET_DTYPE (float32 or bfloat16) is what auto picks when set: the test suite sets float32, as its
checks against transformers are fp32 parity, on whatever CPU runs them.
"""

from __future__ import annotations

import os
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # either one: the CPU computes bf16 products natively


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's feature flags in /proc/cpuinfo (or in `cpuinfo`, its text); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def resolve_dtype(requested: str, device: str = "cpu", cpuinfo: str | None = None,
                  environ=os.environ) -> str | None:
    """`requested` as it is, unless "auto": then DUET_DTYPE when set, else on the CPU bfloat16 where it has one of
    BF16_FLAGS and float32 elsewhere; None (the directory's own dtype) on CUDA."""
    if requested not in DTYPES:
        raise ValueError(f"--dtype {requested!r}: choose one of {', '.join(DTYPES)}")
    if requested != "auto":
        return requested
    pinned = environ.get("DUET_DTYPE", "").strip()
    if pinned:
        if pinned not in DTYPES[1:]:
            raise ValueError(f"DUET_DTYPE={pinned!r}: choose one of {', '.join(DTYPES[1:])}")
        return pinned
    if device == "cuda":
        return None
    return "bfloat16" if cpu_flags(cpuinfo) & set(BF16_FLAGS) else "float32"


def describe(requested: str, resolved: str | None, cpuinfo: str | None = None, environ=os.environ) -> str:
    """Why the worker computes in `resolved`, for its start-up line."""
    if requested != "auto":
        return f"dtype {resolved} (--dtype {requested})"
    if resolved is None:
        return "dtype auto: the model directory's own (CUDA)"
    have = sorted(cpu_flags(cpuinfo) & set(BF16_FLAGS))
    why = f"this CPU has {', '.join(have)}" if have else f"this CPU has none of {', '.join(BF16_FLAGS)}"
    if environ.get("DUET_DTYPE", "").strip():
        why = "DUET_DTYPE"
    return f"dtype auto: {resolved} ({why})"
