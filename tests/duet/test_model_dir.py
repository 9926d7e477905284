"""Reading checkpoint directories: both config.json forms, shards, tied embeddings, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from duet.model_dir import ModelDirError, read_model_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    file.write_text(json.dumps(config))


def test_reads_transformers5_config(tiny_dirs: dict[str, Path]) -> None:
    md = read_model_dir(tiny_dirs["qwen2"])
    c = md.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("qwen2", 1000, 64, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (4, 2, 16, 128)
    assert c.attention_bias and not c.qk_norm and not c.tie_word_embeddings
    assert (c.rope_theta, c.rope_scaling, c.dtype) == (10000.0, None, "float32")
    assert c.eos_token_ids == (0, 2) and c.bos_token_id is None
    assert md.model_id == "qwen2"
    assert md.weight_files == ((tiny_dirs["qwen2"] / "model.safetensors").resolve(),)


def test_qwen3_has_qk_norm_and_tied_embeddings(tiny_dirs: dict[str, Path]) -> None:
    c = read_model_dir(tiny_dirs["qwen3"]).config
    assert c.qk_norm and c.tie_word_embeddings and not c.attention_bias


def test_reads_transformers4_config_with_llama3_scaling(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _copy(tiny_dirs["llama"], tmp_path / "old")
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    _edit_config(path, rope_parameters=None, dtype=None, rope_theta=500000.0, torch_dtype="bfloat16",
                 rope_scaling=scaling, head_dim=None, eos_token_id=7, bos_token_id=5)
    c = read_model_dir(path, model_id="my-model").config
    assert c.rope_theta == 500000.0 and c.dtype == "bfloat16"
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert c.head_dim == 16  # hidden_size / heads when the field is absent
    assert c.bos_token_id == 5
    assert c.eos_token_ids == (7, 0, 2)  # config's eos first, then generation_config's
    assert read_model_dir(path, model_id="my-model").model_id == "my-model"


def test_transformers5_llama3_rope_parameters(tiny_dirs: dict[str, Path]) -> None:
    md = read_model_dir(tiny_dirs["llama3"])
    assert md.config.rope_theta == 500000.0
    assert md.config.rope_scaling["rope_type"] == "llama3"
    assert md.config.rope_scaling["original_max_position_embeddings"] == 256


def test_sharded_checkpoint_lists_every_shard(tiny_dirs: dict[str, Path]) -> None:
    md = read_model_dir(tiny_dirs["llama3"])
    assert [f.name for f in md.weight_files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_missing_shard_is_named(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _copy(tiny_dirs["llama3"], tmp_path / "m")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelDirError, match="model-00002-of-00002.safetensors"):
        read_model_dir(path)


def test_missing_files_are_named(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ModelDirError, match="does not exist"):
        read_model_dir(tmp_path / "nowhere")
    path = _copy(tiny_dirs["llama"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="missing file model.safetensors"):
        read_model_dir(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelDirError, match="missing file config.json"):
        read_model_dir(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "mistral"}, "unsupported architecture 'mistral'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
        ({"dtype": "float8"}, "unsupported dtype 'float8'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
        ({"vocab_size": None}, "lacks the field 'vocab_size'"),
        ({"hidden_size": "64"}, "'hidden_size' must be int"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, tiny_dirs: dict[str, Path], changes: dict, message: str) -> None:
    path = _copy(tiny_dirs["llama"], tmp_path / "m")
    _edit_config(path, **changes)
    with pytest.raises(ModelDirError, match=message):
        read_model_dir(path)


def test_architecture_from_model_type_alone(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _copy(tiny_dirs["qwen3"], tmp_path / "m")
    _edit_config(path, architectures=None)
    assert read_model_dir(path).config.architecture == "qwen3"


def test_unreadable_config_is_a_clear_error(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _copy(tiny_dirs["llama"], tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="cannot read .*config.json"):
        read_model_dir(path)


def test_a_reader_of_the_config_alone_needs_no_weights(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _copy(tiny_dirs["llama"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    md = read_model_dir(path, weights=False)
    assert (md.config.architecture, md.weight_files) == ("llama", ())
    with pytest.raises(ModelDirError, match="missing file model.safetensors"):
        read_model_dir(path)  # the engines' read: the weights must be there
