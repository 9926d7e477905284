"""engine_core/builder.py: the one reading of `--device` for every engine kind, and both kinds' policies as
the CLI offers them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from duet.engine_config import PREFIX_POLICIES
from engine_core.builder import resolve_device
from engine_core.errors import DeviceError
from engine_prefix.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()


def test_auto_and_explicit_devices():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu:0") == torch.device("cpu", 0)


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible")
def test_cuda_without_cuda_is_a_device_error():
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        resolve_device("cuda")


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible")
@pytest.mark.parametrize("kind", ["paged", "prefix"])
def test_duet_engine_on_cuda_without_cuda_says_so_before_listening(kind):
    out = subprocess.run([sys.executable, "-m", "duet.cli", "engine", kind, "--device", "cuda", "--port", "1"],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip() == "duet engine: --device cuda: no CUDA device is visible"


def test_the_cli_offers_exactly_the_prefix_policies():
    assert set(PREFIX_POLICIES) == {p.value for p in Policy}
