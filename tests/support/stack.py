"""The one test harness for live stacks: sim workers as real processes (`duet engine sim`, real gRPC,
killable), gateways either in a thread of the test process (uvicorn; tests can read its internals
and spans) or as `duet gateway --config` processes, and `LiveStack`, the whole thing for the admin,
dashboard and rollback tests (named sims with versions, an admin key, a routing config, one or more
gateway processes sharing Redis), torn down with the test.

    sims = start_sims([Sim("prefix"), Sim("paged", worker_id="p1", version="v2")], tmp)
    gw = GatewayThread(gateway_config(sims)).start()          # in-process gateway
    sims = start_sims([Sim("prefix", model=long_model_dir())], tmp)  # prompts past the tiny model's 2,048 tokens
    gw = GatewayThread(gateway_config(sims, model=long_model_dir())).start()
    stack = LiveStack(tmp, [Sim("paged", worker_id="stable")], admin_key="k").start()  # all processes
    LiveStack(tmp, [Engine("paged", worker_id="slow", env={"DUET_DEBUG_STEP_DELAY_MS": "200"})], ...)  # real engines

Command lines, ports and gateway configs come from the one stack launcher (duet/launcher.py); the
processes here are plain children the tests hold (`.proc`), to freeze, kill or stop one at a time; each dies
with the test process (PR_SET_PDEATHSIG), so a killed pytest leaves none behind.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import uvicorn
import yaml

from duet.launcher import EngineLimits, SimOptions, WorkerSpec, duet_argv, free_port, worker_argv, worker_env
from duet.launcher import gateway_config as launcher_gateway_config
from duet.model_make import default_model_dir, long_context_model_dir
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from duet.supervisor import ask_for_parent_death_signal
from gateway.app import build_app
from gateway.config import from_dict

ROOT = Path(__file__).resolve().parents[2]
# A killed pytest must not leave sims and gateways serving: the kernel sends them SIGTERM when the test
# process dies (PR_SET_PDEATHSIG, as duet/supervisor.py asks for `duet up`'s children). The child only calls
# an already-resolved prctl before exec, so the test process's threads cannot deadlock it.
DIE_WITH_TEST = {"preexec_fn": ask_for_parent_death_signal}


def model_dir() -> Path:
    return default_model_dir()


def long_model_dir() -> Path:
    """The tiny model with a 32k context (duet/model_make.py `tiny-long`): sims and gateways given it take prompts
    the tiny model's 2,048 tokens cannot hold."""
    return long_context_model_dir()


@dataclass
class Sim:
    """One `duet engine sim` process. `worker_id` defaults to its address (the sim's own default)."""

    kind: str = "prefix"  # the engine kind the sim poses as
    ms_per_token: float = 2.0
    fail_rate: float = 0.0
    capabilities: str | None = None
    redis: str | None = None
    worker_id: str | None = None
    version: str = "v1"
    prefill_ms_per_token: float | None = None  # None: the sim's default
    model: Path | None = None  # None: the tiny model (model_dir())
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> Sim:
        sim = SimOptions(self.kind, self.ms_per_token, self.prefill_ms_per_token, self.fail_rate,
                         capabilities=self.capabilities)
        args = worker_argv(WorkerSpec("sim", self.model or model_dir(), self.port, self.worker_id, self.version,
                                      self.redis, sim=sim))
        with open(log_dir / f"sim-{self.worker_id or self.port}.log", "wb") as log:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), **DIE_WITH_TEST)
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

    def stop(self) -> None:
        """SIGTERM (the sim drains), SIGKILL after 10 s."""
        _terminate(self.proc)


@dataclass
class Engine(Sim):
    """One real `duet engine paged|prefix` worker on the tiny model (one torch thread, a small KV budget), in
    a LiveStack like a Sim; `env` is added to its environment (DUET_DEBUG_STEP_DELAY_MS slows it on purpose)."""

    env: dict[str, str] = field(default_factory=dict)

    def start(self, log_dir: Path) -> Engine:
        spec = WorkerSpec(self.kind, self.model or model_dir(), self.port, self.worker_id, self.version,
                          self.redis, device="cpu", threads=1, limits=EngineLimits(kv_cache_tokens=8192))
        with open(log_dir / f"engine-{self.worker_id or self.port}.log", "wb") as log:
            self.proc = subprocess.Popen(worker_argv(spec), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1", **(worker_env(spec) or {}),
                                                  **self.env), **DIE_WITH_TEST)
        return self


def start_sims(sims: list[Sim], log_dir: Path) -> list[Sim]:
    for s in sims:
        s.start(log_dir)
    for s in sims:
        s.wait()
    return sims


def gateway_config(sims: list[Sim], model: Path | None = None, **extra) -> dict:
    """A gateway over `sims` serving `model` (default: the tiny model; the sims' own, given them)."""
    raw = launcher_gateway_config(model or model_dir(), [s.address for s in sims], port=free_port(),
                                  poll_interval_s=0.2)
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
            if self._server.started and sum(1 for v in self.gateway.router.views() if v.healthy) >= want:
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
            self.proc = subprocess.Popen(duet_argv("gateway", "--config", str(path)),
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), **DIE_WITH_TEST)

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
        _terminate(self.proc)


def _terminate(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LiveStack:
    """Sim worker processes plus `gateways` gateway processes (configured with the admin key, the routing
    config and, when given, a shared Redis; several gateways only make sense with redis_url). `start()`
    returns once every gateway reports every sim healthy on /admin/workers."""

    def __init__(self, tmp: Path, sims: list[Sim], admin_key: str, routing: dict | None = None,
                 redis_url: str | None = None, gateways: int = 1) -> None:
        self.tmp = tmp
        self.sims = sims
        self.admin_key = admin_key
        self.routing = routing or {}
        self.redis_url = redis_url
        self.model_dir = model_dir()
        self.model = self.model_dir.name
        self._ports = [free_port() for _ in range(gateways)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self._ports]
        self.url = self.urls[0]
        self.gateways: list[GatewayProcess] = []

    def start(self, timeout_s: float = 60.0) -> LiveStack:
        for s in self.sims:
            s.start(self.tmp)
        extra = {"redis": self.redis_url} if self.redis_url else {}
        for i, port in enumerate(self._ports):
            config = gateway_config(self.sims, port=port, auth={"admin_key": self.admin_key},
                                    health={"poll_interval_s": 0.25}, routing=self.routing, **extra)
            self.gateways.append(GatewayProcess(config, self.tmp, f"gateway{i}"))
        for url in self.urls:
            self.wait_ready(url, timeout_s)
        return self

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = {s.worker_id or s.address for s in self.sims}
        procs = [s.proc for s in self.sims] + [g.proc for g in self.gateways]
        while time.monotonic() < deadline:
            for p in procs:
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
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                         for f in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        procs = [g.proc for g in self.gateways] + [s.proc for s in self.sims if s.proc is not None]
        for p in procs:  # all at once: they drain in parallel
            if p.poll() is None:
                p.terminate()
        for p in procs:
            _terminate(p)
        self.gateways.clear()


def chat_body(model: str, text: str, user: str, max_tokens: int = 4) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "user": user}


class RealWorkers:
    """Real engine workers (engine_core.worker.Worker: real gRPC, the tiny model) served from a private event
    loop thread, so synchronous tests can use them: `RealWorkers([lambda: build_paged(...), ...],
    metrics_ports=[p, None]).ports`, then `stop()`."""

    def __init__(self, builds: list, metrics_ports: list[int | None] | None = None, timeout_s: float = 120.0):
        import asyncio

        from engine_core.worker import Worker

        self._asyncio = asyncio
        ports = metrics_ports or [None] * len(builds)
        self.workers = [Worker(b, port=0, drain_timeout=5, metrics_port=m) for b, m in zip(builds, ports)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ports = [self._run(w.start(), timeout_s) for w in self.workers]

    def _run(self, coro, timeout_s: float):
        return self._asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        for w in self.workers:
            self._run(w.shutdown(), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
