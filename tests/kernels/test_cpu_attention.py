"""The planned CPU attention (one plan per step, SDPA per group) equals the torch references on mixed batches."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import import_module

import pytest
import torch

from engine_core.kernels import cpu_native
from engine_core.kernels.cpu_attention import _decode_groups, paged_attention_planned, plan_paged_attention

decode = import_module("engine_core.kernels.decode_attention")
extend = import_module("engine_core.kernels.extend_attention")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (page_size, num_kv_heads, q/kv ratio, head_dim, dtype, decode context lengths, extend (prefix, new) pairs)
CASES = [
    (16, 3, 3, 64, F32, [600, 601, 602, 603], []),  # one group, no padding, no mask
    (16, 3, 3, 64, F32, [1, 700, 17, 64, 65, 300], []),  # ragged: several groups, masks
    (16, 1, 4, 64, F32, [], [(0, 37)]),  # prefill from scratch: causal SDPA on the new K/V
    (4, 2, 2, 32, F32, [], [(9, 6), (0, 5), (13, 1)]),  # chunks over cached prefixes
    (16, 2, 4, 64, F32, [40, 5, 33], [(0, 20), (31, 9)]),  # the model's mixed step
    (1, 2, 1, 64, F32, [7, 3], [(2, 3)]),  # page size 1, no GQA
    (16, 1, 4, 64, BF16, [20, 2], [(7, 10)]),
    (16, 2, 2, 64, F16, [33], [(0, 16)]),
    # the native extend kernel's tiles: keys past one block of 64, a prefix ending mid-block, heads of 128 (2 rows
    # a block) and of 80 (the portable loops), a group of 7 query heads (rows of a block from two tokens)
    (16, 2, 7, 64, F32, [], [(0, 150), (70, 61)]),
    (8, 2, 2, 128, F32, [90], [(129, 3), (0, 66)]),
    (16, 1, 2, 80, F32, [41], [(17, 45)]),
    # the decode kernel's bf16 dot products: a group of 7 query heads (outputs in registers 4 + 3 at a time), one
    # key only, a context ending mid-pair
    (16, 2, 7, 64, F32, [77, 1, 33], []),
]


def _new_kv(kv, rows):
    """K and V of (sequence, position) pairs as stored in the pages -> [T, Hk, D] each."""
    ps = kv.k_cache.shape[1]
    ks = [kv.k_cache[int(kv.block_tables[b, p // ps]), p % ps] for b, p in rows]
    vs = [kv.v_cache[int(kv.block_tables[b, p // ps]), p % ps] for b, p in rows]
    return torch.stack(ks), torch.stack(vs)


def _run_step(paged_kv, tol, page_size, hk, ratio, d, dtype, dec_lens, ext, native=False):
    """One mixed step (decode rows, then extend chunks) through the planned path, checked against the
    references; returns the plan."""
    lens = dec_lens + [p + n for p, n in ext]
    kv = paged_kv(lens, page_size, hk, d, dtype)
    nd = len(dec_lens)
    new_rows = [(b, n - 1) for b, n in enumerate(dec_lens)]
    for j, (p, n) in enumerate(ext):
        new_rows += [(nd + j, p + t) for t in range(n)]
    q = torch.randn(len(new_rows), hk * ratio, d).to(dtype)
    k, v = _new_kv(kv, new_rows)
    dec_bt, ext_bt = kv.block_tables[:nd], kv.block_tables[nd:]
    cu = torch.tensor([0, *torch.tensor([n for _, n in ext], dtype=torch.int64).cumsum(0).tolist()],
                      dtype=torch.int32)
    prefix = torch.tensor([p for p, _ in ext], dtype=torch.int32)
    scale = d**-0.5
    plan = plan_paged_attention(nd, dec_bt, kv.lens[:nd], ext_bt, cu, prefix, page_size, native)
    out = paged_attention_planned(q, k, v, kv.k_cache, kv.v_cache, plan, scale)
    want = []
    if nd:
        want.append(decode.paged_decode_attention_ref(q[:nd], kv.k_cache, kv.v_cache, dec_bt, kv.lens[:nd], scale))
    if ext:
        want.append(extend.extend_attention_ref(q[nd:], kv.k_cache, kv.v_cache, ext_bt, cu, prefix, scale))
    atol, rtol = tol(dtype)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, torch.cat(want), atol=atol, rtol=rtol)
    return plan


@pytest.mark.parametrize("page_size,hk,ratio,d,dtype,dec_lens,ext", CASES, ids=[str(i) for i in range(len(CASES))])
def test_planned_attention_matches_references(paged_kv, tol, page_size, hk, ratio, d, dtype, dec_lens, ext):
    plan = _run_step(paged_kv, tol, page_size, hk, ratio, d, dtype, dec_lens, ext)
    assert plan.native is None


def test_decode_groups_bound_the_padding():
    # similar lengths share one group; a short row is not padded to a long one
    assert _decode_groups([600, 610, 605]) == [[1, 2, 0]]
    groups = _decode_groups([1000, 10, 990, 20, 15])
    assert groups[0] == [0, 2]
    lens = [1000, 10, 990, 20, 15]
    for g in groups:
        assert len(g) * lens[g[0]] <= 1.25 * sum(lens[i] for i in g)
    assert sorted(i for g in groups for i in g) == list(range(5))


# the native kernels read fp32 or bf16 caches (csrc/kv_type.h): every fp32 case, and each again in bf16
NATIVE_CASES = [c for c in CASES if c[4] == F32] + [(*c[:4], BF16, *c[5:]) for c in CASES if c[4] == F32]


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """A cache dir private to this module: each set of flags is built once here (so the build itself is tested),
    and the cases that build with the same flags load that library."""
    return tmp_path_factory.mktemp("kernel_cache")


@pytest.fixture
def native(monkeypatch, kernel_cache):
    """The native kernels, built into the module's private cache dir. CPU only."""
    if torch.get_default_device().type != "cpu":
        pytest.skip("the native kernel is for CPU tensors")
    monkeypatch.setenv("DUET_CACHE_DIR", str(kernel_cache))
    monkeypatch.delenv("DUET_NATIVE_CPU_ATTENTION", raising=False)
    cpu_native.library.cache_clear()
    yield
    cpu_native.library.cache_clear()


def test_native_kernels_build_where_a_compiler_is(native, kernel_cache):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine: the torch path serves attention")
    assert cpu_native.native_available()
    assert list((kernel_cache / "kernels").glob("cpu_attention-*.so"))
    assert cpu_native.native_applies(torch.device("cpu"), F32, F32)
    assert cpu_native.native_applies(torch.device("cpu"), BF16, BF16)
    assert not cpu_native.native_applies(torch.device("cpu"), F16, F16)
    assert not cpu_native.native_applies(torch.device("cpu"), BF16, F32)


_FLOAT_ENVIRONMENT = """
from engine_core.kernels import cpu_bf16_linear, cpu_int8_linear, cpu_native
tiny = 5e-324  # the smallest subnormal double: denormals-are-zero reads it as 0
assert tiny > 0.0 and tiny * 2.0 > tiny, "subnormals were flushed before loading"
assert cpu_native.library() is not None and cpu_int8_linear.library() is not None
assert cpu_bf16_linear.library() is not None
print(tiny > 0.0 and tiny * 2.0 > tiny)
"""


def test_loading_the_native_kernels_leaves_subnormal_floats_alone(tmp_path):
    """Built with -ffast-math, a library linked with it would carry GCC's crtfastmath constructor, which sets
    flush-to-zero in the loading thread: every float that thread computes afterwards changes (fresh process)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine")
    env = {**os.environ, "DUET_CACHE_DIR": str(tmp_path)}
    env.pop("DUET_NATIVE_CPU_ATTENTION", None)
    env.pop("DUET_NATIVE_CPU_INT8", None)
    done = subprocess.run([sys.executable, "-c", _FLOAT_ENVIRONMENT], check=False, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_native_kernels_can_be_turned_off(native, monkeypatch):
    monkeypatch.setenv("DUET_NATIVE_CPU_ATTENTION", "0")
    assert not cpu_native.native_available()


# The kernels' paths (for a bf16 cache's extend: AMX tiles, or AVX512-BF16 dot products; AVX-512, AVX2, portable C),
# built on one machine by turning the wider ones off: (extra flags, the extend tiles' floats per vector, the CPU
# feature the path needs, the bf16 extend's path). The native build takes the widest the CPU has; the narrower ones
# run anywhere.
_NO_AMX = "-mno-amx-tile -mno-amx-bf16"
_NO_BF16 = f"{_NO_AMX} -mno-avx512bf16"
ISAS = {"amx": ("", 16, "amx_bf16", "amx"), "avx512_bf16": (_NO_AMX, 16, "avx512_bf16", "avx512_bf16"),
        "avx512": (_NO_BF16, 16, "avx512f", "fp32"), "avx2": (f"{_NO_BF16} -mno-avx512f", 8, "avx2", "fp32"),
        "portable": (f"{_NO_BF16} -mno-avx512f -mno-avx2 -mno-fma", 1, "", "fp32")}


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("page_size,hk,ratio,d,dtype,dec_lens,ext", NATIVE_CASES,
                         ids=[str(i) for i in range(len(NATIVE_CASES))])
def test_native_kernels_match_the_references(native, monkeypatch, paged_kv, tol, isa, threads, page_size, hk,
                                             ratio, d, dtype, dec_lens, ext):
    flags, width, feature, bf16_path = ISAS[isa]
    if feature and feature not in cpu_native._cpu_flags().split():
        pytest.skip(f"this CPU has no {feature}")
    if bf16_path != "fp32" and dtype != BF16:
        pytest.skip(f"{isa} serves a bf16 cache's rows (decode and extend); the avx512 cases cover the rest of "
                    f"this build")
    monkeypatch.setenv("DUET_NATIVE_CPU_CFLAGS", flags)
    if not cpu_native.native_available():
        pytest.skip("no C compiler on this machine")
    assert cpu_native.vector_floats() == width  # the path under test is the one that was built
    assert cpu_native.extend_bf16_path() == bf16_path
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = _run_step(paged_kv, tol, page_size, hk, ratio, d, dtype, dec_lens, ext, native=True)
    finally:
        torch.set_num_threads(before)
    # the rows really took the kernels
    assert (plan.native is not None) == bool(dec_lens) and plan.decode == []
    assert (plan.native_extend is not None) == bool(ext) and plan.extend == []
