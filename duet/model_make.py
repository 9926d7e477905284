"""Random-weight checkpoints in Hugging Face format (`duet model make`), and the embedded default model.

`make_checkpoint(out, preset, arch)` writes config.json, model.safetensors (or shards plus
model.safetensors.index.json), tokenizer.json and tokenizer_config.json (with a ChatML chat
template). Identical arguments give identical bytes: weights come from a numpy generator seeded by
(preset, arch), JSON is written with sorted keys, nothing records a time or a path. No torch.

Weights are N(0, 0.02) except q/k projections (scaled so attention is far from uniform); RMSNorm weights are drawn around 1 and qwen2 q/k/v biases are non-zero, so
a parity test against transformers catches a norm or bias that is dropped or misplaced.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from duet.tokenizer_make import SPECIAL_TOKENS, build_tokenizer_json

# Bump when the bytes `make_checkpoint` writes change, so cached default models are remade.
FORMAT_VERSION = "2"
ARCHS = ("llama", "qwen2", "qwen3")
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    # the head is the embedding (default for qwen3 whatever the preset; `tie_word_embeddings=` overrides)
    tie_word_embeddings: bool = False


PRESETS = {
    # A few MB: the tests and the embedded default model.
    "tiny": Preset(1000, 64, 2, 4, 2, 16, 128, 2048),
    # The tiny model with a 32k context (rope as tiny's; no quality is asked of either): live stacks whose prompts
    # the tiny model's 2,048 tokens cannot hold (the selection path's e2e test replays 4k-token documents).
    "tiny-long": Preset(1000, 64, 2, 4, 2, 16, 128, 32768),
    # About 30M parameters: prefill costs real time on a CPU (the engine benchmarks).
    "bench": Preset(8000, 512, 8, 8, 2, 64, 1408, 4096),
    # SmolLM2-135M's shape (about 135M parameters, 540 MB in fp32): timing against peers serving the real one.
    "smollm2": Preset(49152, 576, 30, 9, 3, 64, 1536, 8192, tie_word_embeddings=True),
}

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- elif message['role'] == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('The system message must come first') }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def make_checkpoint(
    out: str | os.PathLike,
    preset: str = "tiny",
    arch: str = "llama",
    *,
    rope_scaling: bool = False,
    tie_word_embeddings: bool | None = None,
    num_shards: int = 1,
) -> Path:
    """Write a checkpoint into `out` (created if missing; our files are overwritten) and return its path.

    rope_scaling: llama only — add Llama-3 rope scaling (factor 8 over 256 original positions).
    tie_word_embeddings: default True for qwen3 (as the small Qwen3 models) and the smollm2 preset, False otherwise.
    num_shards > 1 splits the weights into shards with a model.safetensors.index.json.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    if rope_scaling and arch != "llama":
        raise ValueError("rope_scaling is a Llama-3 feature; use arch='llama'")
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    p = PRESETS[preset]
    tied = (arch == "qwen3" or p.tie_word_embeddings) if tie_word_embeddings is None else tie_word_embeddings
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)

    config = _config(p, arch, rope_scaling, tied)
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"eos_token_id": [0, 2], "pad_token_id": 0})
    _write_weights(path, _weights(p, arch, tied, seed=zlib.crc32(f"{preset}/{arch}".encode())), num_shards)
    (path / "tokenizer.json").write_text(build_tokenizer_json(p.vocab_size) + "\n", encoding="utf-8")
    _write_json(path / "tokenizer_config.json", _tokenizer_config(p))
    return path


def default_model_dir() -> Path:
    """The embedded tiny Llama model, made on first use under the user cache dir and reused after."""
    return cached_model_dir("tiny", "llama")


def long_context_model_dir() -> Path:
    """The tiny Llama model with a 32k context (preset `tiny-long`), made on first use and reused after."""
    return cached_model_dir("tiny-long", "llama")


def cached_model_dir(preset: str, arch: str) -> Path:
    """A preset checkpoint made on first use under the user cache dir (duet/cache_dir.py) and reused after."""
    from duet.cache_dir import build_once, cache_root

    final = cache_root() / "models" / f"{preset}-{arch}-v{FORMAT_VERSION}"
    return build_once(final, lambda tmp: make_checkpoint(tmp, preset=preset, arch=arch))


def _config(p: Preset, arch: str, rope_scaling: bool, tied: bool) -> dict:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {**_LLAMA3_SCALING, "rope_theta": 500000.0}
    config = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": arch,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "tie_word_embeddings": tied,
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": [0, 2],
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_hidden_layers)
    if arch == "qwen3":
        config["attention_bias"] = False
    return config


def _weights(p: Preset, arch: str, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return rng.uniform(0.8, 1.2, size=n).astype(np.float32)

    h, d = p.hidden_size, p.head_dim
    # q/k large enough that attention scores have std ~2: with N(0, 0.02) everywhere attention would be
    # near uniform and a wrong rope (or a wrong mask) would barely move the logits.
    qk_std = 1.4 / float(np.sqrt(h))
    q_out, kv_out = p.num_attention_heads * d, p.num_key_value_heads * d
    w = {"model.embed_tokens.weight": normal(p.vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm(h)
        w[pre + "self_attn.q_proj.weight"] = normal(q_out, h, std=qk_std)
        w[pre + "self_attn.k_proj.weight"] = normal(kv_out, h, std=qk_std)
        w[pre + "self_attn.v_proj.weight"] = normal(kv_out, h)
        w[pre + "self_attn.o_proj.weight"] = normal(h, q_out)
        if arch == "qwen2":
            # Larger than the weights so a dropped bias shows in the logits.
            w[pre + "self_attn.q_proj.bias"] = normal(q_out) * np.float32(10)
            w[pre + "self_attn.k_proj.bias"] = normal(kv_out) * np.float32(10)
            w[pre + "self_attn.v_proj.bias"] = normal(kv_out) * np.float32(10)
        if arch == "qwen3":
            w[pre + "self_attn.q_norm.weight"] = norm(d)
            w[pre + "self_attn.k_norm.weight"] = norm(d)
        w[pre + "post_attention_layernorm.weight"] = norm(h)
        w[pre + "mlp.gate_proj.weight"] = normal(p.intermediate_size, h)
        w[pre + "mlp.up_proj.weight"] = normal(p.intermediate_size, h)
        w[pre + "mlp.down_proj.weight"] = normal(h, p.intermediate_size)
    w["model.norm.weight"] = norm(h)
    if not tied:
        w["lm_head.weight"] = normal(p.vocab_size, h)
    return w


def _write_weights(path: Path, weights: dict[str, np.ndarray], num_shards: int) -> None:
    meta = {"format": "pt"}
    for old in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if num_shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=meta)
        return
    names = list(weights)
    per = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: weights[n] for n in names[s * per:(s + 1) * per]}
        save_file(shard, str(path / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
        total += sum(a.nbytes for a in shard.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _tokenizer_config(p: Preset) -> dict:
    eos, start, end = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "additional_special_tokens": [start, end],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": p.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
