"""Paged decode attention on CPU that reads K/V where they lie in the page cache (csrc/paged_decode.c).

    native_decode_available() -> bool
    paged_decode_native(q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> out [B, Hq, D]

Why: torch has no CPU attention that reads through a page table, so the planned torch path copies every layer's
K/V pages into a contiguous view before SDPA: 39% of a decode step on SmolLM2's shape (docs/benchmarks.md).
This kernel reads each key and value row once, in place. It is plain C, so it builds in about a second with the
system C compiler (no torch headers, no ninja): once per machine and source, into Duet's cache dir, loaded with
ctypes (which releases the GIL during the call). It is built with OpenMP and so needs libgomp.so.1, which torch
has loaded already: the kernel runs on torch's own thread team, as many threads as torch.get_num_threads().

fp32 only (the CPU default); other dtypes, a machine without a C compiler, or DUET_NATIVE_CPU_ATTENTION=0 keep
the torch path, which computes the same thing (tests/kernels/test_cpu_attention.py holds both to the reference).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("duet.kernels")

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math lets the compiler vectorize the dot products' sums and expf (glibc's libmvec); the summation order
# then differs from torch's by float rounding, as any two fp32 attention kernels do. The kernel handles no
# inf/NaN itself (scores of finite K/V are finite), which is what fast-math assumes.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
_I64, _F32 = ctypes.c_int64, ctypes.c_float
_P = ctypes.c_void_p


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them, so a shared cache dir must not mix CPUs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, final: Path) -> None:
    tmp = final.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                   timeout=120)
    os.replace(tmp, final)  # atomic: a concurrent worker building the same library sees all of it or none


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("DUET_NATIVE_CPU_ATTENTION", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: CPU decode attention uses the torch path (pages gathered per layer)")
        return None
    from duet.cache_dir import cache_root

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    final = cache_root() / "kernels" / f"paged_decode-{key}.so"
    try:
        if not final.exists():
            final.parent.mkdir(parents=True, exist_ok=True)
            _build(compiler, final)
        lib = ctypes.CDLL(str(final))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("could not build the native CPU decode attention (%s %s); using the torch path", e,
                    detail.decode(errors="replace")[:500])
        return None
    lib.paged_decode_f32.restype = None
    lib.paged_decode_f32.argtypes = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I64, _I64]
    return lib


def native_decode_available() -> bool:
    return _library() is not None


def native_decode_applies(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether paged_decode_native takes queries of `dtype` over caches of `cache_dtype` on `device` here."""
    return device.type == "cpu" and dtype == cache_dtype == torch.float32 and native_decode_available()


def paged_decode_native(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                        scale: float, max_context: int) -> Tensor:
    """q [B, Hq, D]; caches [pages, page_size, Hk, D] (contiguous); block_tables [B, P] and context_lens [B]
    int32, contiguous (the plan makes them so once per step). Same result as paged_decode_attention_ref."""
    lib = _library()
    assert lib is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    q = q.contiguous()
    rows, hq, d = q.shape
    hk, page_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, -(-max(1, max_context) // 16) * 16 * hq, dtype=torch.float32)
    lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                         block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), rows, hq, hk, d,
                         page_size, scale, scratch.data_ptr(), scratch.stride(0), threads)
    return out
