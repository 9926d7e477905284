"""Turn a GGUF file (llama.cpp's format) into a Hugging Face checkpoint directory, without torch.

`convert_gguf(gguf_path, out_dir, dtype)` reads the file with the `gguf` package, dequantizes every
tensor with its numpy dequantizers (no llama.cpp), and writes what `read_model_dir` and transformers
load: config.json, generation_config.json, model.safetensors (fp32 values; `dtype` only sets the
dtype the engines cast to at load), tokenizer.json, tokenizer_config.json with the chat template. The matrices
stored as Q8_0 are also written as they are, int8 blocks and their scales, into q8_0/blocks.safetensors, which
`--quantization int8` serves without dequantizing or re-quantizing them (engine_core/weights.py).

Two llama.cpp conventions are undone on the way: tensors are stored with their dimensions reversed,
and the q/k projection rows are interleaved per head for llama.cpp's rope (the HF→GGUF converter's
`permute`), so they are put back in Hugging Face's half-split order.

Only what the engines run is accepted: `llama` GGUFs with a GPT-2 style byte-level BPE tokenizer and
the tensor types in SUPPORTED_TYPES. Anything else is a `GGUFError` naming the problem, raised before
any tensor is dequantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from duet.model_dir import Q8_0_FILE

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
TOKEN_TYPE_CONTROL = 3  # llama.cpp's token type for special tokens (<|im_start|>, ...)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """The file is not a GGUF Duet can serve; the message says why."""


def _reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError... on damage
        raise GGUFError(f"{path.name} is not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"GGUF metadata has no {key!r}")
    return value


def read_config(reader, dtype: str) -> dict:
    """config.json (transformers 5.x form) from the GGUF metadata."""
    arch = _require(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise GGUFError("GGUF rope frequency factors (Llama-3.1 style scaling) are not supported")
    p = f"{arch}."
    heads = int(_require(reader, p + "attention.head_count"))
    hidden = int(_require(reader, p + "embedding_length"))
    tokens = _require(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos = int(_require(reader, "tokenizer.ggml.eos_token_id"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_require(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_require(reader, p + "context_length")),
        # stored as float32 in the file: round so 1e-5 reads as 1e-5, not 9.99999974738e-06
        "rms_norm_eps": float(np.format_float_positional(np.float32(_require(reader, p + "attention.layer_norm_rms_epsilon")))),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0))},
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": dtype,
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart Duet knows")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of q/k rows (its converter's `permute`)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, config: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantized to fp32 under its Hugging Face name."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if bad:
        raise GGUFError(f"GGUF tensor type(s) {', '.join(bad)} not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        if t.tensor_type == GGMLQuantizationType.F32:
            array = np.asarray(t.data, dtype=np.float32)
        else:
            array = dequantize(t.data, t.tensor_type).astype(np.float32)
        array = array.reshape(shape)
        if ".attn_q." in t.name:
            array = _unpermute(array, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            array = _unpermute(array, config["num_key_value_heads"])
        weights[_hf_name(t.name)] = np.ascontiguousarray(array)
    return weights


def read_q8_0_blocks(reader, config: dict) -> dict[str, np.ndarray]:
    """Every Q8_0 matrix as its blocks, not dequantized: under its Hugging Face weight name the int8 weights
    [rows, cols], and under `<name>_scale` one fp32 scale per 32 weights of a row [rows, cols / 32] (each block's
    fp16 scale, exactly). The q/k rows are put back in Hugging Face's order, as read_weights does."""
    from gguf import GGMLQuantizationType

    blocks = {}
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.Q8_0 or len(t.shape) != 2:
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
        raw = np.asarray(t.data, dtype=np.uint8).reshape(rows, cols // 32, 34)  # a block: fp16 scale, 32 x int8
        scale = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].astype(np.float32)
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(rows, cols)
        for suffix, heads in ((".attn_q.", "num_attention_heads"), (".attn_k.", "num_key_value_heads")):
            if suffix in t.name:
                q, scale = _unpermute(q, config[heads]), _unpermute(scale, config[heads])
        name = _hf_name(t.name)
        blocks[name], blocks[f"{name}_scale"] = np.ascontiguousarray(q), np.ascontiguousarray(scale)
    return blocks


def tokenizer_json(reader) -> dict:
    """A `tokenizers` byte-level BPE (GPT-2 style, digits split one by one) from the GGUF vocab."""
    model = _require(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE)")
    tokens = [str(t) for t in _require(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [str(m) for m in _require(reader, "tokenizer.ggml.merges")]
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)) if kind == TOKEN_TYPE_CONTROL]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def tokenizer_config(reader, config: dict) -> dict:
    tokens = _require(reader, "tokenizer.ggml.tokens")
    template = _field(reader, "tokenizer.chat_template")
    if template is None:
        raise GGUFError("GGUF file has no chat template (tokenizer.chat_template)")

    def token(key: str) -> str | None:
        idx = _field(reader, key)
        return str(tokens[int(idx)]) if idx is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": str(template),
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face directory for `gguf_path` into `out_dir` (created) and return it."""
    from safetensors.numpy import save_file

    if dtype not in ("float32", "bfloat16"):
        raise GGUFError(f"dtype {dtype!r} not supported for GGUF models (float32 or bfloat16)")
    reader = _reader(Path(gguf_path))
    config = read_config(reader, dtype)
    tok_json, tok_config = tokenizer_json(reader), tokenizer_config(reader, config)
    weights = read_weights(reader, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    blocks = read_q8_0_blocks(reader, config)
    if blocks:  # what `--quantization int8` serves as it is (duet/model_dir.py, engine_core/weights.py)
        (out / Q8_0_FILE).parent.mkdir(exist_ok=True)
        save_file(blocks, str(out / Q8_0_FILE), metadata={"format": "pt"})
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"]}
    for name, obj in (("config.json", config), ("generation_config.json", generation),
                      ("tokenizer_config.json", tok_config), ("tokenizer.json", tok_json)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
