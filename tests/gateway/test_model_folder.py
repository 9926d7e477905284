"""The gateway reads a model folder's config.json, tokenizer and chat template, never its weights: a folder
without them serves (a `duet gateway` process and a sim worker on it), while an engine, which loads the weights,
refuses that folder by name before it opens its port."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx

from duet.launcher import Launcher, WorkerSpec, duet_argv, free_port, gateway_config, healthy_workers
from duet.model_make import default_model_dir

ROOT = Path(__file__).resolve().parents[2]


def _without_weights(dst: Path) -> Path:
    """The default model's folder with every weight file left out: config, generation config, tokenizer."""
    shutil.copytree(default_model_dir(), dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "q8_0"))
    assert not list(dst.glob("*.safetensors")) and (dst / "tokenizer.json").is_file()
    return dst


def test_a_gateway_serves_a_model_folder_without_weights(tmp_path):
    model = _without_weights(tmp_path / "no-weights")
    worker, gateway = free_port(), free_port()
    url = f"http://127.0.0.1:{gateway}"
    with Launcher(tmp_path / "logs") as stack:
        stack.start_worker("sim", WorkerSpec("sim", model, worker, "sim-0"))
        stack.start_gateway("gateway", gateway_config(model, [f"127.0.0.1:{worker}"], port=gateway))
        stack.wait_until(lambda: healthy_workers(url) >= 1, timeout_s=60)
        models = httpx.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["no-weights"]
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "no-weights", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_an_engine_refuses_a_model_folder_without_weights_by_name(tmp_path):
    model = _without_weights(tmp_path / "no-weights")
    for kind in ("paged", "prefix"):
        done = subprocess.run(duet_argv("engine", kind, "--model", str(model), "--port", str(free_port())),
                              check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert done.stderr.strip().splitlines()[-1] == (
            f"duet engine {kind}: cannot serve {model}: missing file model.safetensors "
            f"(or model.safetensors.index.json) in {str(model)!r}"), done.stderr
