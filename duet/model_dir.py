"""Read a Hugging Face checkpoint directory into a small frozen config (no torch).

`read_model_dir(path)` accepts config.json in the transformers 4.x form (`rope_theta`,
`rope_scaling`, `torch_dtype`) and the 5.x form (`rope_parameters`, `dtype`), weights as one
model.safetensors or as shards listed by model.safetensors.index.json, and Llama, Qwen2 or Qwen3
models. Anything else — an unknown architecture, a missing file, a feature the engines do not
implement — raises ModelDirError naming the file or the field, before any weight is read.
`weights=False` is for readers of config.json alone (the gateway, the sim worker): the folder need not hold
the weights, and `weight_files` is then empty; the engines, which load them, keep the default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ARCH_BY_CLASS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_DTYPES = ("float32", "float16", "bfloat16")
# written by duet/gguf.py for a GGUF's Q8_0 matrices; in a folder of its own, because vLLM (and other loaders) read
# every *.safetensors file at the top of a checkpoint directory as the model's weights
Q8_0_FILE = "q8_0/blocks.safetensors"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ModelDirError(ValueError):
    """The directory is not a checkpoint Duet can serve; the message says which file or field."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (qwen3)
    dtype: str  # "float32" | "float16" | "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelDir:
    path: Path
    model_id: str
    config: ModelConfig
    weight_files: tuple[Path, ...]
    # a converted GGUF's Q8_0 blocks (Q8_0_FILE, written by duet/gguf.py), which `--quantization int8` serves as they are
    q8_0_file: Path | None = None


def read_model_dir(path: str | Path, model_id: str | None = None, *, weights: bool = True) -> ModelDir:
    """Read and validate the checkpoint at `path`. `model_id` defaults to the directory's name; with
    `weights=False` no weight file is looked for (module doc)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelDirError(f"model directory {str(root)!r} does not exist")
    raw = _read_json(root / "config.json")
    config = _parse_config(raw, root / "config.json", _read_generation_eos(root))
    return ModelDir(
        path=root.resolve(),
        model_id=model_id or root.resolve().name,
        config=config,
        weight_files=_weight_files(root) if weights else (),
        q8_0_file=root / Q8_0_FILE if (root / Q8_0_FILE).is_file() else None,
    )


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ModelDirError(f"missing file {file.name} in {str(file.parent)!r}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{file} must hold a JSON object")
    return data


def _architecture(raw: dict, where: Path) -> str:
    classes = raw.get("architectures") or []
    for cls in classes:
        if cls in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[cls]
    if not classes and raw.get("model_type") in _ARCH_BY_CLASS.values():
        return raw["model_type"]
    name = ", ".join(classes) if classes else repr(raw.get("model_type"))
    raise ModelDirError(
        f"unsupported architecture {name} in {where}; Duet serves {', '.join(_ARCH_BY_CLASS)}"
    )


def _field(raw: dict, key: str, where: Path, kind: type = int) -> Any:
    if key not in raw or raw[key] is None:
        raise ModelDirError(f"{where} lacks the field {key!r}")
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ModelDirError(f"{where}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _rope(raw: dict, where: Path) -> tuple[float, dict | None]:
    # 5.x: rope_parameters holds theta and the scaling; 4.x: rope_theta beside rope_scaling.
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type form; all our layers are full attention
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelDirError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ModelDirError(f"{where}: unsupported rope scaling {rope_type!r}; Duet supports default and llama3")
    missing = [k for k in _LLAMA3_KEYS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ModelDirError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    out = {"rope_type": "llama3", **{k: float(scaling[k]) for k in _LLAMA3_KEYS}}
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return float(theta), out


def _token_ids(value: Any, key: str, where: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelDirError(f"{where}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _read_generation_eos(root: Path) -> tuple[int, ...]:
    file = root / "generation_config.json"
    if not file.is_file():
        return ()
    return _token_ids(_read_json(file).get("eos_token_id"), "eos_token_id", file)


def _parse_config(raw: dict, where: Path, generation_eos: tuple[int, ...]) -> ModelConfig:
    arch = _architecture(raw, where)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelDirError(f"{where}: unsupported hidden_act {raw['hidden_act']!r}; Duet supports silu")
    if raw.get("mlp_bias"):
        raise ModelDirError(f"{where}: mlp_bias is not supported")
    if arch != "qwen2" and raw.get("attention_bias"):
        raise ModelDirError(f"{where}: attention_bias is not supported for {arch}")
    if raw.get("use_sliding_window"):
        raise ModelDirError(f"{where}: sliding-window attention is not supported")
    heads = _field(raw, "num_attention_heads", where)
    hidden = _field(raw, "hidden_size", where)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise ModelDirError(f"{where}: num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads}")
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in _DTYPES:
        raise ModelDirError(f"{where}: unsupported dtype {dtype!r}; Duet supports {', '.join(_DTYPES)}")
    theta, scaling = _rope(raw, where)
    eos = _token_ids(raw.get("eos_token_id"), "eos_token_id", where)
    eos = tuple(dict.fromkeys(eos + generation_eos))  # union, order kept
    bos = _token_ids(raw.get("bos_token_id"), "bos_token_id", where)
    return ModelConfig(
        architecture=arch,
        vocab_size=_field(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", where),
        num_hidden_layers=_field(raw, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_field(raw, "max_position_embeddings", where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        dtype=dtype,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
    )


def _weight_files(root: Path) -> tuple[Path, ...]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelDirError(f"{index} has no weight_map")
        files = tuple(root / name for name in sorted(set(weight_map.values())))
    elif (root / "model.safetensors").is_file():
        files = (root / "model.safetensors",)
    else:
        raise ModelDirError(
            f"missing file model.safetensors (or model.safetensors.index.json) in {str(root)!r}"
        )
    for f in files:
        if not f.is_file():
            raise ModelDirError(f"missing file {f.name} in {str(root)!r} (listed in {index.name})")
    return tuple(f.resolve() for f in files)
