"""The one stack launcher: Duet's processes (engine workers, gateways, a private Redis, `duet lb`) started
under a `duet.supervisor.Supervisor`, each on a port, each with its log, waited for, and torn down.

`duet up`, the benchmarks (`duet bench compare | peer | chaos`, the gateway bench) and the tests start
stacks through it:

    port = free_port()                                      # the one free-port helper
    launcher = Launcher(log_dir)                            # logs: log_dir/<name>.log
    launcher.start_worker("paged-0", WorkerSpec("paged", model, port, limits=EngineLimits()))
    launcher.start_gateway("gateway", gateway_config(model, [f"127.0.0.1:{port}"], port=free_port()))
    launcher.wait_until(lambda: healthy_workers(url) >= 1, timeout_s=300)
    launcher.shutdown()                                     # SIGTERM, drain, SIGKILL after the grace period

`worker_argv` passes each engine kind only the flags it reads (`duet engine paged|prefix|sim`): a
limit the caller set is never dropped silently, and a kind is never handed a flag it would reject.
`WorkerSpec.cpus` (and `start_gateway(cpus=)`) pins a process to cores with `taskset -c`, which execs the
command: the supervisor's pid is the process itself (`duet bench compare --pin-cores`, `duet bench classes`).
The module imports no torch and nothing from loadtests/ (`duet up` uses it).
"""

from __future__ import annotations

import json
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import yaml

from duet import scale_out
from duet.contract import PAGED, SIM, WORKER_KINDS
from duet.engine_config import ENGINE_DEFAULTS
from duet.supervisor import Event, RestartPolicy, Supervisor

_LISTEN_FLOOR = 20000  # below: well-known and registered service ports


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, below the kernel's ephemeral range where there is room. A port the
    kernel picks (bind to 0) comes from that range, from which every outgoing connection also takes its local port,
    so a listener started moments later could find its port taken by a connection of the very stack it belongs to
    (a test run saw a gateway fail with "address already in use" that way). Another process may still bind the
    port before us."""
    top = _ephemeral_floor() - 1
    pick = random.SystemRandom()  # not the random module's state, which tests seed
    for _ in range(64 if top - _LISTEN_FLOOR >= 1000 else 0):
        with socket.socket() as s:
            try:
                s.bind((host, pick.randint(_LISTEN_FLOOR, top)))
            except OSError:
                continue  # in use
            return s.getsockname()[1]
    with socket.socket() as s:  # no room below the ephemeral range, or all tries taken: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands outgoing connections (Linux's default when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def duet_argv(*args: str) -> list[str]:
    """`duet ARGS...` as this interpreter runs it (the virtualenv's, with this checkout on the path)."""
    return [sys.executable, "-m", "duet.cli", *args]


class StackError(RuntimeError):
    """The stack did not come up (a child exited while starting, or it was not ready in time)."""


@dataclass(frozen=True)
class EngineLimits:
    """What a real engine worker gets for its KV budget, batch limits and torch threads (a benchmark gives
    every worker the same, so configurations differ only in engine kinds and routing)."""

    kv_cache_tokens: int = 32768
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    page_size: int = ENGINE_DEFAULTS.page_size
    torch_threads: int = 1
    paged_prefix_caching: bool = True  # engine_paged's automatic prefix caching (--[no-]enable-prefix-caching)
    quantization: str = "none"  # --quantization (int8: weight-only int8 on the CPU)
    dtype: str | None = None  # --dtype (None: the worker's default, auto)


@dataclass(frozen=True)
class SimOptions:
    """The model-free worker's timing and pose (`duet engine sim --sim-*`); None: the sim's default."""

    as_kind: str = "prefix"
    ms_per_token: float | None = None
    prefill_ms_per_token: float | None = None
    fail_rate: float | None = None
    cache_blocks: int | None = None
    capabilities: str | None = None
    load_s: float | None = None  # NOT_SERVING this long after it listens, as an engine loading its model


@dataclass(frozen=True)
class WorkerSpec:
    """One `duet engine KIND` process. None: the worker's own default for that flag."""

    kind: str  # one of duet.contract.WORKER_KINDS
    model: Path
    port: int
    worker_id: str | None = None  # None: host:port
    version: str | None = None
    redis: str | None = None
    device: str | None = None  # real engines only
    threads: int | None = None  # real engines only
    dtype: str | None = None  # real engines only: --dtype (None: the worker's default, auto)
    tensor_parallel_size: int = 1  # real engines only: ranks (devices) the worker splits its model over
    limits: EngineLimits | None = None  # real engines only
    metrics_port: int | None = None  # real engines only: where it serves Prometheus /metrics (None: off)
    extra_args: tuple[str, ...] = ()  # real engines only: more `duet engine KIND` flags, passed as they are
    sim: SimOptions | None = None  # sim only
    cpus: str | None = None  # a taskset core list ("0", "2-3"): pin the process to those cores (None: anywhere)


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """`argv` run on the cores `cpus` (taskset execs it, so the pid is the command's own)."""
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


def _flags(pairs: list[tuple[str, object]]) -> list[str]:
    return [arg for flag, value in pairs if value is not None for arg in (flag, str(value))]


def worker_argv(spec: WorkerSpec) -> list[str]:
    """The command line of one worker, with only the flags its kind reads (pinned when `spec.cpus`)."""
    return pinned(_engine_argv(spec), spec.cpus)


def _engine_argv(spec: WorkerSpec) -> list[str]:
    if spec.kind not in WORKER_KINDS:
        raise ValueError(f"unknown engine kind {spec.kind!r}")
    argv = duet_argv("engine", spec.kind, "--model", str(spec.model), "--port", str(spec.port))
    argv += _flags([("--worker-id", spec.worker_id), ("--version", spec.version), ("--redis", spec.redis)])
    if spec.kind == SIM:
        assert spec.limits is None and spec.device is None and spec.threads is None and \
            spec.tensor_parallel_size == 1 and spec.metrics_port is None and not spec.extra_args, \
            "a sim reads no engine limits"
        sim = spec.sim or SimOptions()
        return argv + _flags([("--sim-as", sim.as_kind), ("--sim-ms-per-token", sim.ms_per_token),
                              ("--sim-prefill-ms-per-token", sim.prefill_ms_per_token),
                              ("--sim-fail-rate", sim.fail_rate), ("--sim-cache-blocks", sim.cache_blocks),
                              ("--sim-capabilities", sim.capabilities), ("--sim-load-s", sim.load_s)])
    assert spec.sim is None, "sim options on a real engine worker"
    argv += _flags([("--device", spec.device), ("--threads", spec.threads), ("--dtype", spec.dtype),
                    ("--tensor-parallel-size", spec.tensor_parallel_size if spec.tensor_parallel_size > 1 else None),
                    ("--metrics-port", spec.metrics_port)])
    lim = spec.limits
    if lim is not None:
        argv += _flags([("--page-size", lim.page_size), ("--kv-cache-tokens", lim.kv_cache_tokens),
                        ("--max-num-seqs", lim.max_num_seqs),
                        ("--max-num-batched-tokens", lim.max_num_batched_tokens)])
        if lim.quantization != "none":
            argv += ["--quantization", lim.quantization]
        if lim.dtype is not None and spec.dtype is None:
            argv += ["--dtype", lim.dtype]
        if spec.kind == PAGED:
            argv.append("--enable-prefix-caching" if lim.paged_prefix_caching else "--no-enable-prefix-caching")
    return argv + list(spec.extra_args)


def worker_env(spec: WorkerSpec) -> dict[str, str] | None:
    """One torch thread count for every BLAS pool of the worker, when its limits set one."""
    if spec.limits is None or spec.kind == SIM:
        return None
    n = str(spec.limits.torch_threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def gateway_config(model: Path, addresses: list[str], *, port: int, host: str = "127.0.0.1",
                   poll_interval_s: float = 0.5, **extra) -> dict:
    """A `duet gateway --config` document over the given workers (extra: routing, auth, redis, ...)."""
    return {"host": host, "port": port, "models": [{"path": str(model)}],
            "workers": [{"address": a} for a in addresses], "health": {"poll_interval_s": poll_interval_s}, **extra}


# -- readiness probes ------------------------------------------------------------------------------
def healthy_workers(url: str) -> int:
    """How many workers the gateway at `url` sees healthy (its /ready; 0 while it does not answer)."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return 0
    return sum(body.get("healthy_workers", {}).values())


def admin_workers(url: str, admin_key: str) -> list[dict]:
    """A gateway's view of its workers (GET /admin/workers); [] while it is not answering."""
    req = urllib.request.Request(url + "/admin/workers", headers={"authorization": f"Bearer {admin_key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())["workers"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return []


def listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class Launcher:
    """The processes of one stack under one Supervisor (`self.supervisor`: drills kill and restart through
    it); `with Launcher(...)` shuts everything down on exit."""

    def __init__(self, log_dir: Path, policy: RestartPolicy | None = None,
                 on_event: Callable[[Event], None] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.supervisor = Supervisor(self.log_dir, policy, on_event=on_event)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start_worker(self, name: str, spec: WorkerSpec) -> int:
        return self.supervisor.start(name, worker_argv(spec), env=worker_env(spec))

    def start_gateway(self, name: str, config: dict, env: dict[str, str] | None = None,
                      cpus: str | None = None) -> int:
        """Write `config` to log_dir/NAME.yaml and start `duet gateway --config` on it (on cores `cpus`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return self.supervisor.start(name, pinned(duet_argv("gateway", "--config", str(path)), cpus), env=env)

    def start_redis(self, name: str = "redis") -> str:
        """A private redis-server (gateway replicas share state through it); its URL once it answers."""
        port = free_port()
        self.supervisor.start(name, scale_out.redis_server_command(port))
        scale_out.wait_for_redis(port)
        return f"redis://127.0.0.1:{port}/0"

    def start_balancer(self, host: str, port: int, gateway_ports: list[int], name: str = "lb") -> int:
        return self.supervisor.start(name, duet_argv(*scale_out.balancer_args(host, port, gateway_ports)))

    def exited(self) -> list[str]:
        """The children not running now (while starting: a bad flag or model)."""
        return [n for n in self.supervisor.names() if self.supervisor.pid(n) is None]

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str = "not ready",
                   abort: Callable[[], bool] | None = None, interval_s: float = 0.2) -> bool:
        """Poll `ready` until it holds (True), `abort` holds (False), a child exits or the time is up
        (StackError, with the exited child's log tail)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if abort is not None and abort():
                return False
            if exited := self.exited():
                raise StackError(f"{exited[0]} exited while starting:\n{self.supervisor.log_tail(exited[0])}")
            if time.monotonic() > deadline:
                raise StackError(f"{what} after {timeout_s:.0f}s; logs in {self.log_dir}")
            time.sleep(interval_s)
        return True

    def shutdown(self) -> None:
        self.supervisor.shutdown()
