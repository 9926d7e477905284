"""Real engine workers on SmolLM2 (one `duet engine paged`, one `duet engine prefix`, real gRPC) with
one in-process gateway in front of each, so a test can pick the engine it talks to."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from duet.launcher import WorkerSpec, free_port, gateway_config, worker_argv
from tests.support.stack import ROOT, GatewayThread


class RealStack:
    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.model = model_dir.name
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.gateways: dict[str, GatewayThread] = {}

    def start(self) -> RealStack:
        ports = {}
        for kind in ("paged", "prefix"):
            ports[kind] = free_port()
            with open(self.log_dir / f"{kind}.log", "wb") as log:
                argv = worker_argv(WorkerSpec(kind, self.model_dir, ports[kind], f"{kind}-real", device="cpu"))
                self.procs[kind] = subprocess.Popen(
                    [*argv, "--kv-cache-tokens", "16384"],  # the KV budget alone: the other limits stay the engine's
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        for kind, port in ports.items():
            config = gateway_config(self.model_dir, [f"127.0.0.1:{port}"], port=free_port(), poll_interval_s=0.2)
            try:
                self.gateways[kind] = GatewayThread(config).start(timeout_s=240)
            except RuntimeError as exc:
                raise RuntimeError(f"{kind} worker did not come up:\n{self.log(kind)}") from exc
        return self

    def log(self, kind: str) -> str:
        return (self.log_dir / f"{kind}.log").read_text(errors="replace")[-3000:]

    def url(self, kind: str) -> str:
        return self.gateways[kind].url

    def stop(self) -> None:
        for gw in self.gateways.values():
            gw.stop()
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
