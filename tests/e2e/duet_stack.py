"""Test harness for the gateway tests: sim workers as real processes (`duet engine sim`, real gRPC,
killable), gateways either in a thread of the test process (uvicorn; tests can read its internals
and spans) or as `duet gateway --config` processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import uvicorn
import yaml

from duet.model_make import default_model_dir
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from gateway.app import build_app
from gateway.config import from_dict

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> Path:
    return default_model_dir()


@dataclass
class Sim:
    """One `duet engine sim` process."""

    kind: str = "prefix"
    ms_per_token: float = 2.0
    fail_rate: float = 0.0
    capabilities: str | None = None
    redis: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> Sim:
        args = [sys.executable, "-m", "duet.cli", "engine", "sim", "--model", str(model_dir()),
                "--port", str(self.port), "--sim-as", self.kind, "--sim-ms-per-token", str(self.ms_per_token),
                "--sim-fail-rate", str(self.fail_rate)]
        if self.capabilities is not None:
            args += ["--sim-capabilities", self.capabilities]
        if self.redis is not None:
            args += ["--redis", self.redis]
        with open(log_dir / f"sim-{self.port}.log", "wb") as log:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
        return self

    def wait(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim on {self.port} exited with {self.proc.returncode}")
            try:
                self.load(timeout=0.5)
                return
            except grpc.RpcError:
                time.sleep(0.1)
        raise RuntimeError(f"sim on {self.port} did not start in {timeout_s}s")

    def load(self, timeout: float = 2.0) -> pb.EngineLoad:
        with grpc.insecure_channel(self.address) as ch:
            return pb_grpc.EngineStub(ch).GetLoad(pb.GetLoadRequest(), timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_sims(sims: list[Sim], log_dir: Path) -> list[Sim]:
    for s in sims:
        s.start(log_dir)
    for s in sims:
        s.wait()
    return sims


def gateway_config(sims: list[Sim], **extra) -> dict:
    raw = {"host": "127.0.0.1", "port": free_port(), "models": [{"path": str(model_dir())}],
           "workers": [{"address": s.address} for s in sims], "health": {"poll_interval_s": 0.2}}
    raw.update(extra)
    return raw


class GatewayThread:
    """A gateway app served by uvicorn in a thread of this process."""

    def __init__(self, raw_config: dict, **app_kwargs) -> None:
        self.config = from_dict(raw_config)
        self.app = build_app(self.config, **app_kwargs)
        self.gateway = self.app.state.gateway
        self.url = f"http://127.0.0.1:{self.config.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.config.port,
                                                     log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self, wait_workers: int | None = None, timeout_s: float = 20.0) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        want = len(self.config.workers) if wait_workers is None else wait_workers
        while time.monotonic() < deadline:
            if (self._server.started and self.gateway.pool is not None
                    and sum(1 for v in self.gateway.views() if v.healthy) >= want):
                return self
            time.sleep(0.05)
        raise RuntimeError("gateway thread did not become ready")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


class GatewayProcess:
    """`duet gateway --config FILE` as a child process."""

    def __init__(self, raw_config: dict, tmp: Path, name: str = "gateway") -> None:
        self.port = raw_config["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw_config))
        self._log = tmp / f"{name}.log"
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "gateway", "--config", str(path)],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 30.0) -> GatewayProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self._log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready: {self._log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
