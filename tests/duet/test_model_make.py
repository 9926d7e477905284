"""`duet model make`: deterministic bytes, checkpoints transformers loads and runs, the embedded default."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors import safe_open

from duet.cli import main as duet_main
from duet.model_dir import read_model_dir
from duet.model_make import PRESETS, default_model_dir, make_checkpoint

ARCHS = ("llama", "qwen2", "qwen3")


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_makes_give_identical_bytes(tmp_path: Path, arch: str, tiny_dirs: dict[str, Path]) -> None:
    again = make_checkpoint(tmp_path / "again", "tiny", arch)
    assert _files(again) == _files(tiny_dirs[arch])


def test_different_archs_get_different_weights(tiny_dirs: dict[str, Path]) -> None:
    blobs = {(tiny_dirs[a] / "model.safetensors").read_bytes() for a in ARCHS}
    assert len(blobs) == 3


def test_tokenizer_training_is_identical_in_a_fresh_process() -> None:
    # The BPE trainer runs in Rust with hash maps seeded per process: prove a new process agrees.
    code = (
        "import hashlib;from duet.tokenizer_make import build_tokenizer_json as b;"
        "print(hashlib.sha256((b(1000)+b(8000)).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "1"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout == here.stdout


@pytest.mark.parametrize("arch", [*ARCHS, "llama3"])
def test_transformers_loads_and_runs_every_arch(arch: str, tiny_dirs: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    expected = {"llama": "Llama", "llama3": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    assert type(model).__name__ == f"{expected}ForCausalLM"
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 42, 999]])).logits
    assert logits.shape == (1, 5, 1000)
    assert torch.isfinite(logits).all() and logits.std() > 0.01
    # Every tensor in the file was used: nothing random-initialised behind our back.
    state = model.state_dict()
    config = read_model_dir(tiny_dirs[arch]).config
    for f in read_model_dir(tiny_dirs[arch]).weight_files:
        with safe_open(f, "np") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                assert torch.equal(state[name], torch.from_numpy(sf.get_tensor(name))), name
    assert ("lm_head.weight" in _tensor_names(tiny_dirs[arch])) == (not config.tie_word_embeddings)


def _tensor_names(path: Path) -> set[str]:
    names: set[str] = set()
    for f in read_model_dir(path).weight_files:
        with safe_open(f, "np") as sf:
            names |= set(sf.keys())
    return names


def test_arch_features_are_in_the_weights(tiny_dirs: dict[str, Path]) -> None:
    qwen2 = _tensor_names(tiny_dirs["qwen2"])
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2
    qwen3 = _tensor_names(tiny_dirs["qwen3"])
    assert "model.layers.1.self_attn.k_norm.weight" in qwen3
    assert not any(n.endswith(".bias") for n in _tensor_names(tiny_dirs["llama"]))
    with safe_open(tiny_dirs["llama"] / "model.safetensors", "np") as sf:
        norm = sf.get_tensor("model.layers.0.input_layernorm.weight")
    assert norm.min() != norm.max()  # random norm weights, so parity tests see a misplaced norm


def test_bench_preset_is_20_to_40m_params(bench_dir: Path) -> None:
    md = read_model_dir(bench_dir)
    total = 0
    for f in md.weight_files:
        with safe_open(f, "np") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                total += math.prod(sf.get_slice(name).get_shape())
    assert 20e6 <= total <= 40e6
    assert md.config.vocab_size == 8000
    assert len(json.loads((bench_dir / "tokenizer.json").read_text())["model"]["vocab"]) == 8000


def test_smollm2_preset_has_the_real_models_parameter_count() -> None:
    # HuggingFaceTB/SmolLM2-135M: 134,515,008 parameters, tied embeddings (written without making the 540 MB)
    p = PRESETS["smollm2"]
    h, q, kv = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * p.intermediate_size + 2 * h
    assert p.vocab_size * h + p.num_hidden_layers * layer + h == 134_515_008
    assert p.tie_word_embeddings


def test_cli_model_make(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert duet_main(["model", "make", "--out", str(out), "--preset", "tiny", "--arch", "qwen3"]) == 0
    assert str(out) in capsys.readouterr().out
    md = read_model_dir(out)
    assert md.config.architecture == "qwen3" and md.config.qk_norm and md.config.tie_word_embeddings


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_checkpoint(tmp_path, "huge", "llama")
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_checkpoint(tmp_path, "tiny", "gpt2")
    with pytest.raises(ValueError, match="rope_scaling"):
        make_checkpoint(tmp_path, "tiny", "qwen2", rope_scaling=True)


def test_default_model_dir_is_made_once_even_when_raced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def use() -> None:
        try:
            results.append(default_model_dir())
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    path = results[0]
    assert read_model_dir(path).config.architecture == "llama"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left behind
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not remade
