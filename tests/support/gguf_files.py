"""Small GGUF files written with the gguf package's own writer, the way llama.cpp's converter writes them
(dimensions reversed, q/k rows interleaved per head), from the tiny random checkpoint (tests/duet/test_gguf.py,
tests/engine_core/test_q8_0_serving.py)."""

from __future__ import annotations

import json

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from duet.model_dir import read_model_dir
from duet.model_make import default_model_dir
from duet.tokenizer import Tokenizer

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows of each head interleaved for its rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{HF_TO_GGUF[module]}.weight"


def write_gguf(path, *, arch="llama", quant=None, tokenizer_model="gpt2", drop_template=False, iq2_tensor=False):
    """The tiny random checkpoint as a GGUF; `quant` quantizes every 2-D weight; `iq2_tensor` adds one
    tensor of a type we do not dequantize (raw blocks: 256 values in 66 bytes)."""
    src = default_model_dir()
    cfg = read_model_dir(src).config
    tok = json.loads((src / "tokenizer.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i < 3 else 1 for i in range(len(vocab))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    if not drop_template:
        w.add_chat_template(Tokenizer.from_dir(src).chat_template)
    for name, t in weights.items():
        if "q_proj" in name:
            t = _llama_cpp_permute(t, cfg.num_attention_heads)
        elif "k_proj" in name:
            t = _llama_cpp_permute(t, cfg.num_key_value_heads)
        if quant is not None and t.ndim == 2:
            w.add_tensor(_gguf_name(name), quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(_gguf_name(name), t)
    if iq2_tensor:
        w.add_tensor("blk.0.attn_q_extra.weight", np.zeros((1, 66), dtype=np.uint8),
                     raw_dtype=GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src, weights
