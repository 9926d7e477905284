"""duet/auto_dtype.py: `--dtype auto` picks bf16 on a CPU with AMX or AVX512_BF16 and fp32 elsewhere, from
/proc/cpuinfo's flags (torch-free), and says why."""

from __future__ import annotations

import pytest

from duet.auto_dtype import cpu_flags, describe, resolve_dtype
from duet.engine_config import ENGINE_DEFAULTS

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"


@pytest.mark.parametrize("cpuinfo,want", [(SAPPHIRE_RAPIDS, "bfloat16"), (ZEN4, "bfloat16"),
                                          (ICE_LAKE, "float32"), (ZEN3, "float32"), ("", "float32")])
def test_auto_is_bf16_only_where_the_cpu_multiplies_bf16(cpuinfo, want):
    assert resolve_dtype("auto", "cpu", cpuinfo, environ={}) == want
    assert resolve_dtype("float32", "cpu", cpuinfo, environ={}) == "float32"  # an explicit choice stands
    assert resolve_dtype("bfloat16", "cpu", cpuinfo, environ={}) == "bfloat16"


def test_auto_is_the_default_and_keeps_the_directory_dtype_on_cuda():
    assert ENGINE_DEFAULTS.dtype == "auto"
    assert resolve_dtype("auto", "cuda", SAPPHIRE_RAPIDS, environ={}) is None


def test_duet_dtype_pins_what_auto_picks_and_bad_values_are_refused():
    assert resolve_dtype("auto", "cpu", SAPPHIRE_RAPIDS, environ={"DUET_DTYPE": "float32"}) == "float32"
    assert resolve_dtype("bfloat16", "cpu", ZEN3, environ={"DUET_DTYPE": "float32"}) == "bfloat16"
    with pytest.raises(ValueError, match="DUET_DTYPE='fp8'"):
        resolve_dtype("auto", "cpu", ZEN3, environ={"DUET_DTYPE": "fp8"})
    with pytest.raises(ValueError, match="--dtype 'half'"):
        resolve_dtype("half", "cpu", ZEN3, environ={})


def test_the_start_line_says_why():
    assert describe("auto", "bfloat16", SAPPHIRE_RAPIDS, environ={}) == \
        "dtype auto: bfloat16 (this CPU has amx_bf16, avx512_bf16)"
    assert describe("auto", "float32", ZEN3, environ={}) == \
        "dtype auto: float32 (this CPU has none of amx_bf16, avx512_bf16)"
    assert describe("float32", "float32", SAPPHIRE_RAPIDS, environ={}) == "dtype float32 (--dtype float32)"
    assert "sse" in cpu_flags(ZEN3) and cpu_flags("no flags line") == set()
