"""Checkpoints made once per test session with `duet.model_make` (the same files users get)."""

from __future__ import annotations

from pathlib import Path

import pytest

from duet.model_make import make_checkpoint

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> tiny checkpoint dir; also "llama3" (rope scaling, 2 shards)."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {arch: make_checkpoint(root / arch, "tiny", arch) for arch in ARCHS}
    dirs["llama3"] = make_checkpoint(root / "llama3", "tiny", "llama", rope_scaling=True, num_shards=2)
    return dirs


@pytest.fixture(scope="session")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bench") / "qwen2", "bench", "qwen2")
