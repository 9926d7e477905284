"""Load Hugging Face safetensors checkpoints (single file or sharded) into DecoderModel.

HF names map to our parameters; q/k/v land in row ranges of the packed qkv_proj and gate/up in gate_up_proj.
Every expected tensor must be present exactly with its expected shape; anything else is a WeightsError that
names the tensor and the file. Tensors that carry no weight (rotary inv_freq buffers) are skipped, and so is
lm_head.weight of a tied-embedding model (the head is the embedding).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

from engine_core.errors import WeightsError


class Target(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, start + rows) of our parameter `param`."""

    param: str
    start: int
    rows: int


def checkpoint_layout(model: nn.Module) -> dict[str, Target]:
    """HF tensor name -> Target, for every tensor a checkpoint of this model must contain."""
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size
    params = dict(model.named_parameters())
    layout: dict[str, Target] = {}

    def whole(hf: str, ours: str) -> None:
        if ours in params:
            layout[hf] = Target(ours, 0, params[ours].shape[0])

    whole("model.embed_tokens.weight", "embed_tokens.weight")
    whole("model.norm.weight", "norm.weight")
    whole("lm_head.weight", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            packed = f"{ours}self_attn.qkv_proj.{kind}"
            if packed in params:
                layout[f"{hf}self_attn.q_proj.{kind}"] = Target(packed, 0, q)
                layout[f"{hf}self_attn.k_proj.{kind}"] = Target(packed, q, kv)
                layout[f"{hf}self_attn.v_proj.{kind}"] = Target(packed, q + kv, kv)
            whole(f"{hf}self_attn.o_proj.{kind}", f"{ours}self_attn.o_proj.{kind}")
        whole(f"{hf}self_attn.q_norm.weight", f"{ours}self_attn.q_norm")
        whole(f"{hf}self_attn.k_norm.weight", f"{ours}self_attn.k_norm")
        layout[f"{hf}mlp.gate_proj.weight"] = Target(f"{ours}mlp.gate_up_proj.weight", 0, inter)
        layout[f"{hf}mlp.up_proj.weight"] = Target(f"{ours}mlp.gate_up_proj.weight", inter, inter)
        whole(f"{hf}mlp.down_proj.weight", f"{ours}mlp.down_proj.weight")
        whole(f"{hf}input_layernorm.weight", f"{ours}input_layernorm.weight")
        whole(f"{hf}post_attention_layernorm.weight", f"{ours}post_attention_layernorm.weight")
    return layout


def _skipped(name: str, model: nn.Module) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def load_weights(model: nn.Module, weight_files, shard: Callable[[str, Tensor], Tensor] | None = None) -> None:
    """Fill every parameter of `model` from the safetensors files (cast to the parameter's dtype and device).

    `shard(name, tensor)`, when given, cuts each checkpoint tensor to this process's part before the shape check
    (tensor parallelism: engine_core.parallel.plan); the model is then built with the per-rank sizes."""
    layout = checkpoint_layout(model)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in map(Path, weight_files):
        if not path.is_file():
            raise WeightsError(f"weight file {path} does not exist")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if _skipped(name, model):
                    continue
                if name not in layout:
                    raise WeightsError(f"{path.name}: unexpected tensor {name!r}; this checkpoint does not match "
                                       f"a {model.config.architecture} model with this config.json")
                if name in loaded:
                    raise WeightsError(f"{path.name}: tensor {name!r} appears in more than one weight file")
                target = layout[name]
                param = params[target.param]
                expected = (target.rows, *param.shape[1:])
                tensor = f.get_tensor(name)
                if shard is not None:
                    tensor = shard(name, tensor)
                if tuple(tensor.shape) != expected:
                    raise WeightsError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                       f"config.json implies {expected}")
                with torch.no_grad():
                    param.data[target.start:target.start + target.rows].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(layout) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightsError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def load_q8_0_blocks(model: nn.Module, path: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """A converted GGUF's Q8_0 matrices (duet/gguf.py's q8_0/blocks.safetensors) by our parameter name: the int8
    weights [out, in] and one scale per 32 of a row's weights [out, in / 32], q/k/v and gate/up stacked into the
    fused parameters as load_weights stacks them. A fused parameter with a part that was not Q8_0 in the file is
    left out (it is quantized per channel from its fp32 weights)."""
    layout = checkpoint_layout(model)
    params = dict(model.named_parameters())
    parts: dict[str, list[tuple[Target, Tensor, Tensor]]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if name.endswith("_scale"):
                continue
            target = layout.get(name)
            q, scale = f.get_tensor(name), f.get_tensor(f"{name}_scale")
            if target is None or q.shape != (target.rows, *params[target.param].shape[1:]):
                raise WeightsError(f"{path.name}: int8 blocks {name!r} {tuple(q.shape)} do not match this model")
            parts.setdefault(target.param, []).append((target, q, scale))
    blocks = {}
    for param, found in parts.items():
        found.sort(key=lambda part: part[0].start)
        if sum(t.rows for t, _, _ in found) == params[param].shape[0]:
            blocks[param] = (torch.cat([q for _, q, _ in found]), torch.cat([s for _, _, s in found]))
    return blocks
