"""The engine's model runner end to end with the Triton kernels forced (interpreter on CPU): the tiny
checkpoint gives the same greedy tokens as on the torch reference path."""

from __future__ import annotations

import os

import pytest
import torch

from duet.model_make import make_checkpoint
from engine_core import LLM, SamplingParams

ON_CUDA = os.environ.get("DUET_KERNEL_TEST_DEVICE", "cpu") == "cuda"  # make gpu-check (see conftest.py)


@pytest.mark.parametrize("arch,page_size", [("llama", 4), ("qwen3", 1)])
def test_triton_path_gives_the_reference_greedy_tokens(tmp_path, monkeypatch, arch, page_size):
    checkpoint = make_checkpoint(tmp_path / arch, preset="tiny", arch=arch)
    # two ragged prompts over small pages: prefill crosses page boundaries, decode batches two lengths
    prompts = [[5, 17, 99, 3, 250, 41, 7], [11, 12, 13]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("DUET_KERNELS", backend)
        llm = LLM(checkpoint, device="cuda" if ON_CUDA else "cpu", dtype=torch.float32, page_size=page_size)
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert all(len(t) == 5 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]
