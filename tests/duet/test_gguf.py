"""GGUF -> Hugging Face directory on small files written here with the gguf package's own writer, the
way llama.cpp's converter writes them (dimensions reversed, q/k rows interleaved per head): the round
trip gives back the checkpoint, quantized tensors dequantize, and what we cannot serve is a clear error
before any tensor is read. The real SmolLM2 file is checked against transformers in tests/realmodel."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from duet.gguf import GGUFError, convert_gguf
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


def test_f32_round_trip_gives_back_the_checkpoint(tmp_path):
    src, weights = write_gguf(tmp_path / "m.gguf")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    for name, t in weights.items():
        np.testing.assert_array_equal(got[name], t, err_msg=name)
    a, b = read_model_dir(src).config, read_model_dir(out).config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "tie_word_embeddings"):
        assert getattr(a, field) == getattr(b, field), field
    tok = Tokenizer.from_dir(out)
    assert tok.token_to_id("<|im_end|>") == 2 and 2 in b.eos_token_ids


def test_q8_0_weights_dequantize_close_to_the_original(tmp_path):
    _, weights = write_gguf(tmp_path / "q.gguf", quant=GGMLQuantizationType.Q8_0)
    got = load_file(str(convert_gguf(tmp_path / "q.gguf", tmp_path / "hf", dtype="bfloat16") / "model.safetensors"))
    for name, t in weights.items():
        assert np.abs(got[name] - t).max() <= np.abs(t).max() / 100, name  # 8-bit blocks: within 1% of range
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("kw, words", [
    ({"arch": "gpt2"}, "architecture 'gpt2' is not supported"),
    ({"tokenizer_model": "llama"}, "tokenizer model 'llama' is not supported"),
    ({"drop_template": True}, "no chat template"),
    ({"iq2_tensor": True}, "IQ2_XXS not supported"),
])
def test_what_we_cannot_serve_is_a_clear_error(tmp_path, kw, words):
    write_gguf(tmp_path / "x.gguf", **kw)
    with pytest.raises(GGUFError, match=words):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_a_truncated_or_missing_file_is_a_clear_error(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "hf")
    with pytest.raises(GGUFError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "hf")
