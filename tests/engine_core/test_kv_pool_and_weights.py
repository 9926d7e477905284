"""KV page budget and allocator; the weight loader's sharded path and its errors on bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from duet.model_dir import read_model_dir
from engine_core import LLM, CapacityError, SamplingParams, WeightsError
from engine_core.kv_pool import PageAllocator, kv_bytes_per_token, pages_for_budget


def test_pages_for_budget_from_tokens_or_memory(hf_checkpoints):
    config = read_model_dir(hf_checkpoints["llama"][0]).config
    assert pages_for_budget(config, 16, kv_cache_tokens=100) == 7  # rounded up to whole pages
    per_token = kv_bytes_per_token(config)  # 2 (K,V) * 2 layers * 2 kv heads * 16 dims * 4 bytes
    assert per_token == 2 * 2 * 2 * 16 * 4
    assert pages_for_budget(config, 16, kv_cache_memory_gb=1.0) == 2**30 // (per_token * 16)
    assert pages_for_budget(config, 16, kv_cache_memory_gb=1.0, dtype="bfloat16") == 2**30 // (per_token * 8)
    with pytest.raises(ValueError, match="not both"):
        pages_for_budget(config, 16, kv_cache_tokens=10, kv_cache_memory_gb=1.0)
    with pytest.raises(ValueError, match="holds no KV page"):
        pages_for_budget(config, 16, kv_cache_memory_gb=1e-9)


def test_page_allocator_hands_out_distinct_pages_and_takes_them_back():
    alloc = PageAllocator(10)
    a, b = alloc.alloc(4), alloc.alloc(6)
    assert len(set(a) | set(b)) == 10 and alloc.num_free == 0
    with pytest.raises(CapacityError, match="need 1 KV pages, only 0 of 10"):
        alloc.alloc(1)
    alloc.free(a)
    alloc.check_integrity()
    assert alloc.num_free == 4 and sorted(alloc.alloc(4)) == sorted(a)
    alloc.check_integrity()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_and_matches(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["qwen3"]
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [4, 8, 15, 16, 23, 42]
    assert LLM(tmp_path / "sharded").generate([prompt], p)[0].outputs == LLM(path).generate([prompt], p)[0].outputs


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing 1 tensor.*model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
     r"'model.layers.0.self_attn.k_proj.weight' has shape \(16, 64\), config.json implies \(32, 64\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.weight": torch.zeros(2)}),
     "unexpected tensor 'model.layers.0.mlp.experts.weight'"),
])
def test_bad_checkpoints_fail_with_a_message_naming_the_tensor(hf_checkpoints, tmp_path, edit, message):
    path = _copy(hf_checkpoints["llama"][0], tmp_path / "ckpt")
    _rewrite(path, edit)
    with pytest.raises(WeightsError, match=message):
        LLM(path)


def test_a_checkpoint_for_another_config_is_rejected(hf_checkpoints, tmp_path):
    path = _copy(hf_checkpoints["llama"][0], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"mlp\.\w+_proj\.weight' has shape .*config.json implies"):
        LLM(path)
