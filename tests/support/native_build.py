"""Builds one of Duet's native CPU libraries (engine_core/kernels/csrc) for a test, into a private cache dir, with
the extra compiler flags of the path under test, and checks that the build has that path (so the build itself is
tested). Shared by the int8 and bf16 matmul kernels' tests."""

from __future__ import annotations

import os
import shutil

import pytest

from engine_core.kernels import cpu_native


def native_builder(monkeypatch, tmp_path, module, stem: str, paths: dict, fallback: str):
    """`build(path)` for `module` (its `library()` and `vector_path()`), `paths` naming each path's (extra flags,
    whether the build has the vector loop, the CPU feature it needs); skips where the CPU lacks the feature or
    there is no C compiler (then `fallback` serves)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip(f"no C compiler on this machine: {fallback}")
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DUET_NATIVE_CPU_INT8", raising=False)
    monkeypatch.delenv("DUET_NATIVE_CPU_BF16", raising=False)

    def build(path: str) -> None:
        flags, vector, feature = paths[path]
        if feature and feature not in cpu_native._cpu_flags().split():
            pytest.skip(f"this CPU has no {feature}")
        monkeypatch.setenv("DUET_NATIVE_CPU_CFLAGS", flags)
        module.library.cache_clear()
        assert module.library() is not None
        assert module.vector_path() == vector  # the path under test is the one that was built
        assert list((tmp_path / "kernels").glob(f"{stem}-*.so"))

    return build
