"""GGUF -> Hugging Face directory on small files written with the gguf package's own writer, the way
llama.cpp's converter writes them (tests/support/gguf_files.py): the round trip gives back the checkpoint, quantized
tensors dequantize, Q8_0 matrices are also kept as their int8 blocks, and what we cannot serve is a clear error
before any tensor is read. The real SmolLM2 file is checked against transformers in tests/realmodel."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from duet.gguf import GGUFError, convert_gguf
from duet.model_dir import read_model_dir
from duet.tokenizer import Tokenizer
from tests.support.gguf_files import write_gguf


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


def test_q8_0_matrices_are_also_written_as_their_int8_blocks(tmp_path):
    weights = write_gguf(tmp_path / "q.gguf", quant=GGMLQuantizationType.Q8_0)[1]
    out = convert_gguf(tmp_path / "q.gguf", tmp_path / "hf")
    dequantized, blocks = load_file(str(out / "model.safetensors")), load_file(str(out / "q8_0" / "blocks.safetensors"))
    assert read_model_dir(out).q8_0_file == out / "q8_0" / "blocks.safetensors"
    # vLLM reads every *.safetensors file at the top of a checkpoint as weights: the blocks must not be one
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    matrices = sorted(name for name, t in weights.items() if t.ndim == 2)
    assert sorted(name for name in blocks if not name.endswith("_scale")) == matrices
    for name in matrices:
        q, scale = blocks[name], blocks[f"{name}_scale"]
        assert q.dtype == np.int8 and q.shape == weights[name].shape
        assert scale.dtype == np.float32 and scale.shape == (q.shape[0], q.shape[1] // 32)
        # the blocks times their scales are exactly what the gguf package dequantizes (same rows, same order)
        assert np.array_equal(q.astype(np.float32) * np.repeat(scale, 32, axis=1), dequantized[name]), name
    # no Q8_0 matrix, no blocks file
    write_gguf(tmp_path / "f.gguf")
    assert read_model_dir(convert_gguf(tmp_path / "f.gguf", tmp_path / "f32")).q8_0_file is None


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
