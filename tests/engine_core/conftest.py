"""Tiny random checkpoints written by transformers itself (the reference nobody here wrote), one per
architecture the engine core claims: Llama, Llama with Llama-3 rope scaling, Qwen2 (qkv bias, tied
embeddings) and Qwen3 (q/k norm, head_dim != hidden/heads). fp32, seeded, a wide init so greedy choices are
decided by clear margins rather than float noise."""

from __future__ import annotations

import pytest
import torch

VOCAB = 256
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "initializer_range": 0.3, "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-6}


def _hf_model(arch: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False))
    if arch == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32, "rope_theta": 500000.0}
        return LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling=scaling, tie_word_embeddings=False))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=True))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, rope_theta=10000.0, tie_word_embeddings=False))
    raise ValueError(arch)


ARCHS = ("llama", "llama3", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> (checkpoint dir, the transformers model in eval mode)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(1234 + i)
        model = _hf_model(arch).float().eval()
        # HF inits norms to ones and biases to zeros; random values prove we load and apply each of them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.3)
        path = tmp_path_factory.mktemp(f"ckpt_{arch}")
        model.save_pretrained(path, safe_serialization=True)
        out[arch] = (path, model)
    return out


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param
