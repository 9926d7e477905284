"""A live Duet stack for the dashboard and rollback tests: `duet engine sim` workers and one
`duet gateway --config` process, each a real process on a free port, torn down with the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from duet.model_make import default_model_dir

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SimSpec:
    worker_id: str
    kind: str = "paged"  # the engine kind the sim poses as
    version: str = "v1"
    ms_per_token: float = 2.0
    prefill_ms_per_token: float = 0.05
    fail_rate: float = 0.0
    port: int = field(default_factory=free_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class LiveStack:
    def __init__(self, tmp: Path, sims: list[SimSpec], admin_key: str, routing: dict | None = None,
                 redis_url: str | None = None, gateways: int = 1) -> None:
        self.tmp = tmp
        self.sims = sims
        self.admin_key = admin_key
        self.routing = routing or {}
        self.redis_url = redis_url
        self.model_dir = default_model_dir()
        self.model = self.model_dir.name
        # several gateways only make sense sharing state: pass redis_url with gateways > 1
        self.urls = [f"http://127.0.0.1:{free_port()}" for _ in range(gateways)]
        self.url = self.urls[0]
        self._procs: list[subprocess.Popen] = []

    def _spawn(self, args: list[str], name: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.tmp / f"{name}.log", "wb") as log:  # the child keeps its own copy of the fd
            self._procs.append(subprocess.Popen([sys.executable, "-m", "duet.cli", *args], cwd=ROOT, env=env,
                                                stdout=log, stderr=subprocess.STDOUT))

    def start(self, timeout_s: float = 60.0) -> LiveStack:
        for s in self.sims:
            self._spawn(["engine", "sim", "--model", str(self.model_dir), "--port", str(s.port),
                         "--worker-id", s.worker_id, "--version", s.version, "--sim-as", s.kind,
                         "--sim-ms-per-token", str(s.ms_per_token),
                         "--sim-prefill-ms-per-token", str(s.prefill_ms_per_token),
                         "--sim-fail-rate", str(s.fail_rate)], s.worker_id)
        for i, url in enumerate(self.urls):
            config = {
                "host": "127.0.0.1", "port": int(url.rsplit(":", 1)[1]),
                "models": [{"path": str(self.model_dir)}],
                "workers": [{"address": s.address} for s in self.sims],
                "auth": {"admin_key": self.admin_key},
                "health": {"poll_interval_s": 0.25},
                "routing": self.routing,
            }
            if self.redis_url:
                config["redis"] = self.redis_url
            path = self.tmp / f"gateway{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            self._spawn(["gateway", "--config", str(path)], f"gateway{i}")
        for url in self.urls:
            self.wait_ready(url, timeout_s)
        return self

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = {s.worker_id for s in self.sims}
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a stack process exited with {p.returncode}:\n{self.logs()}")
            try:
                r = httpx.get(url + "/admin/workers", headers=self.admin_headers, timeout=1.0)
                if r.status_code == 200:
                    healthy = {w["worker_id"] for w in r.json()["workers"] if w.get("healthy")}
                    if want <= healthy:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the stack was not ready within {timeout_s}s:\n{self.logs()}")

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def logs(self) -> str:
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()


def chat_body(model: str, text: str, user: str, max_tokens: int = 4) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "user": user}
