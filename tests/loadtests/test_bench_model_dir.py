"""A benchmark's --model takes what the engines take: a directory, or a pullable name (compare and classes)."""

from __future__ import annotations

import pytest

from loadtests.experiments.compare import CompareError, bench_model_dir


def test_a_pullable_name_is_the_pulled_directory(smollm2_dir):
    from duet.model_registry import DEFAULT_MODEL

    assert bench_model_dir(DEFAULT_MODEL, "smollm2") == smollm2_dir
    assert bench_model_dir(str(smollm2_dir), "smollm2") == smollm2_dir


def test_a_path_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CompareError, match="not a model directory"):
        bench_model_dir(str(tmp_path), "smollm2")
