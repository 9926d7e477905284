"""The native CPU attention kernels (csrc/*.c): built once per machine with the system C compiler, loaded with ctypes.

    native_available() -> bool
    native_applies(device, dtype, cache_dtype) -> bool   # CPU, fp32 or bf16 queries and caches, the library built
    library() -> ctypes.CDLL | None                      # paged_{decode,extend}_{f32,bf16}
    vector_floats() -> int                               # the extend tiles' width: 16 (AVX-512), 8 (AVX2), 1 (C)
    build_and_load(stem, sources, what) -> ctypes.CDLL | None  # any csrc library (cpu_int8_linear.py's too)

Why: torch has no CPU attention that reads K/V through a page table, so its path copies every layer's pages into
contiguous K/V first, and its fused SDPA runs prefill at about 130 GFLOP/s here. The kernels read pages where they
lie (cpu_paged_decode.py, cpu_paged_extend.py say what each wins). They are plain C, so they build in a few
seconds with the system C compiler (no torch headers, no ninja), into Duet's cache dir, keyed by the sources, the
flags and the CPU's features. Built with OpenMP, the library needs libgomp.so.1, which torch has loaded already:
the dynamic linker reuses it, so the kernels run on torch's own thread team (as many threads as
torch.get_num_threads(), passed in). ctypes releases the GIL during a call.

The decode kernel has an AVX-512 path and portable C (which reads memory in order, at memory speed, on AVX2
CPUs); the extend kernel has AVX-512 and AVX2 tiles and portable C; -march=native picks the widest the CPU has.
DUET_NATIVE_CPU_CFLAGS adds compiler flags after Duet's (e.g. `-mno-avx512f` to build for AVX2 on a fleet that
mixes CPUs; the tests use it to run every path on one machine).

Each kernel is built twice, for an fp32 and for a bf16 KV cache (csrc/kv_type.h: the `_bf16` sources include the
fp32 ones with KV_BF16 defined); queries, outputs and all arithmetic are fp32 in both, so a bf16 model's queries are
widened for the call (but for the bf16 kernels on AMX tiles or AVX512-BF16 dot products, which round queries and
probabilities to bf16: `extend_bf16_path()` says which the extend kernel runs; the decode kernel takes the dot
products wherever the build has AVX512-BF16, "avx512_bf16" and "amx" alike).
Other dtypes (fp16), a machine without a C compiler, or DUET_NATIVE_CPU_ATTENTION=0 keep the
torch path, which computes the same thing (tests/kernels/test_cpu_attention.py holds both to the references).
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
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("duet.kernels")

_CSRC = Path(__file__).parent / "csrc"
_SOURCE_NAMES = ("paged_decode.c", "paged_extend.c", "paged_decode_bf16.c", "paged_extend_bf16.c")
# the kernels' element types (csrc/kv_type.h): the symbol suffix for each KV cache dtype
KV_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# -ffast-math lets the compiler vectorize sums and expf (glibc's libmvec); the summation order then differs from
# torch's by float rounding, as any two fp32 attention kernels do. The kernels handle no inf/NaN themselves
# (scores of finite K/V are finite), which is what fast-math assumes. -march=native prefers 256-bit vectors on
# recent Xeons; the loops the compiler vectorizes (softmax, exp) measured faster at 512 bits (where there are any).
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {  # each kernel's ctypes argument types
    **{f"paged_decode_{kv}": [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I64, _I64]
       for kv in KV_SUFFIX.values()},
    **{f"paged_extend_{kv}": [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _F32, _P, _P, _P,
                              _I64, _I64] for kv in KV_SUFFIX.values()},
}


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them, so a shared cache dir must not mix CPUs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# Compiled with -ffast-math but linked without it: GCC links crtfastmath.o into a library linked with it, whose
# constructor sets flush-to-zero and denormals-are-zero in the loading thread's MXCSR, which silently changes float
# results for everything else that thread computes (hypothesis, for one, refuses to run). Part of the cache key.
_RECIPE = "compile with the flags, link without -ffast-math"


def _build(compiler: str, flags: list[str], sources: list[Path], final: Path) -> None:
    tmp = final.with_suffix(f".{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory(dir=final.parent) as objects:
        paths = [str(Path(objects) / f"{i}-{source.stem}.o") for i, source in enumerate(sources)]
        for source, path in zip(sources, paths):
            subprocess.run([compiler, *flags, "-c", str(source), "-o", path], check=True, capture_output=True,
                           timeout=120)
        link = [flag for flag in flags if flag != "-ffast-math"]
        subprocess.run([compiler, *link, *paths, "-o", str(tmp), "-lm"], check=True, capture_output=True,
                       timeout=120)
    os.replace(tmp, final)  # atomic: a concurrent worker building the same library sees all of it or none


def build_and_load(stem: str, sources: list[Path], what: str) -> ctypes.CDLL | None:
    """The library built from `sources` for this CPU (once, into the cache dir), loaded; None (logged, naming
    `what` falls back) where there is no compiler or the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: %s", what)
        return None
    from duet.cache_dir import cache_root

    flags = _FLAGS + os.environ.get("DUET_NATIVE_CPU_CFLAGS", "").split()
    # the headers beside the sources are part of what gets compiled (csrc/kv_type.h)
    files = [*sources, *sorted({h for s in sources for h in s.parent.glob("*.h")})]
    key = hashlib.sha256(b"".join(f.read_bytes() for f in files) + " ".join(flags).encode()
                         + _cpu_flags().encode() + _RECIPE.encode()).hexdigest()[:16]
    final = cache_root() / "kernels" / f"{stem}-{key}.so"
    try:
        if not final.exists():
            final.parent.mkdir(parents=True, exist_ok=True)
            _build(compiler, flags, sources, final)
        return ctypes.CDLL(str(final))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("could not build %s (%s %s): %s", stem, e, detail.decode(errors="replace")[:500], what)
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("DUET_NATIVE_CPU_ATTENTION", "1") == "0":
        return None
    return load_attention("cpu_attention", _CSRC, "CPU attention uses the torch path (pages gathered per layer)")


def load_attention(stem: str, csrc: Path, what: str) -> ctypes.CDLL | None:
    """The attention kernels built from the sources in `csrc` (this checkout's, or another's: decode_attention_bench
    --against), their ctypes signatures set; None where `build_and_load` fails."""
    lib = build_and_load(stem, [csrc / name for name in _SOURCE_NAMES], what)
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    lib.paged_vector_floats.restype, lib.paged_vector_floats.argtypes = ctypes.c_int, []
    lib.paged_extend_bf16_path.restype, lib.paged_extend_bf16_path.argtypes = ctypes.c_int, []
    return lib


def vector_floats() -> int:
    """The floats per vector of the built extend kernel's tiles (0 when the kernels are not built)."""
    lib = library()
    return lib.paged_vector_floats() if lib is not None else 0


def extend_bf16_path() -> str:
    """How the bf16 extend kernel runs its blocks here: "amx" (tiles: built for a CPU that has them, lent by the
    OS), "avx512_bf16" (bf16 dot products), "fp32" (fp32 arithmetic), "" (the kernels are not built)."""
    lib = library()
    return "" if lib is None else ("fp32", "avx512_bf16", "amx")[lib.paged_extend_bf16_path()]


def native_available() -> bool:
    return library() is not None


def native_applies(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the native kernels take queries of `dtype` over caches of `cache_dtype` on `device` here."""
    return device.type == "cpu" and dtype == cache_dtype and dtype in KV_SUFFIX and native_available()
