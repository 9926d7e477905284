"""A serving stack for a benchmark: N engine workers and one or more gateways as child processes.

`ServingStack(model, kinds, routing, ...)` is a context manager: on entry it starts one
`duet engine KIND` per entry of `kinds` (each on a free port, the same page size, KV budget and
batch limits, one torch thread each so that workers do not fight over the cores), then
`gateways` × `duet gateway --config` with the given `routing` section (and `gateway_extra` keys,
e.g. a shared `redis` and `timeouts`), and waits until every gateway sees every worker healthy (its
/admin/workers, not just /ready, which needs only one). The children run under a
`duet.supervisor.Supervisor` (`self.supervisor`, for drills that kill and restart them); on exit it
stops them all (SIGTERM, drain, SIGKILL after a grace period). A child that dies while starting
raises `StackError` with the tail of its log.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import yaml

from duet.engine_config import ENGINE_DEFAULTS
from duet.supervisor import RestartPolicy, Supervisor

ADMIN_KEY = "bench-admin"  # the stack is private to the benchmark: a fixed key is enough


class StackError(RuntimeError):
    """The stack did not come up (a child exited, or not every worker got healthy in time)."""


@dataclass(frozen=True)
class EngineLimits:
    """What every worker of every configuration gets, so that configurations differ only in
    engine kinds and routing."""

    kv_cache_tokens: int = 32768
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    page_size: int = ENGINE_DEFAULTS.page_size
    torch_threads: int = 1
    paged_prefix_caching: bool = True  # engine_paged with prefix caching, where the engine has it (below)


def _duet(*args: str) -> list[str]:
    return [sys.executable, "-m", "duet.cli", *args]


def paged_prefix_caching_flags() -> list[str]:
    """`--enable-prefix-caching`: `duet engine paged` takes it (duet.engine_config.PagedConfig)."""
    return ["--enable-prefix-caching"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServingStack:
    def __init__(self, model: str | Path, kinds: list[str], routing: dict, limits: EngineLimits = EngineLimits(),
                 ready_timeout_s: float = 300.0, log_dir: Path | None = None, gateways: int = 1,
                 gateway_extra: dict | None = None, policy: RestartPolicy | None = None,
                 pool_planner: dict | None = None) -> None:
        self.model = Path(model)
        self.kinds = list(kinds)
        self.routing = dict(routing)
        self.limits = limits
        self.ready_timeout_s = ready_timeout_s
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="duet-bench-"))
        self.supervisor = Supervisor(self.log_dir, policy)
        self.num_gateways = gateways
        self.gateway_extra = dict(gateway_extra or {})
        self.url = ""
        self.urls: list[str] = []
        self.worker_addresses: dict[str, str] = {}  # worker id -> host:port
        self.pool_planner = pool_planner  # the gateway's planner settings (a stack with a pool manager)
        self.slots: list[tuple[str, str, int]] = []  # (worker id, kind, port)

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.supervisor.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.supervisor.shutdown()

    def _start(self) -> None:
        lim = self.limits
        addresses = []
        # the children inherit the environment: one torch thread per worker (the gateway has no torch)
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ.update(OMP_NUM_THREADS=str(lim.torch_threads), MKL_NUM_THREADS=str(lim.torch_threads))
        try:
            for i, kind in enumerate(self.kinds):
                port = free_port()
                self.start_worker(f"{kind}-{i}", kind, port)
                self.slots.append((f"{kind}-{i}", kind, port))
                addresses.append(f"127.0.0.1:{port}")
                self.worker_addresses[f"{kind}-{i}"] = addresses[-1]
            for g in range(self.num_gateways):
                port = free_port()
                config = {"host": "127.0.0.1", "port": port, "models": [{"path": str(self.model)}],
                          "workers": [{"address": a} for a in addresses], "health": {"poll_interval_s": 0.5},
                          "auth": {"admin_key": ADMIN_KEY}, "routing": self.routing, **self.gateway_extra}
                if self.pool_planner is not None:
                    config["pool_planner"] = self.pool_planner
                name = "gateway" if self.num_gateways == 1 else f"gateway-{g}"
                path = self.log_dir / f"{name}.yaml"
                path.write_text(yaml.safe_dump(config))
                self.supervisor.start(name, _duet("gateway", "--config", str(path)))
                self.urls.append(f"http://127.0.0.1:{port}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.url = self.urls[0]
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if exited := [n for n in self.supervisor.names() if self.supervisor.pid(n) is None]:
                raise StackError(f"{exited[0]} exited while starting:\n{self.supervisor.log_tail(exited[0])}")
            views = [self.workers(u) for u in self.urls]
            if all(len(rows) == len(self.kinds) and all(r["healthy"] for r in rows) for rows in views):
                return
            if time.monotonic() > deadline:
                raise StackError(f"not every worker healthy after {self.ready_timeout_s:.0f}s; logs in {self.log_dir}")
            time.sleep(0.25)

    def start_worker(self, worker_id: str, kind: str, port: int) -> None:
        lim = self.limits
        extra = paged_prefix_caching_flags() if kind == "paged" and lim.paged_prefix_caching else []
        self.supervisor.start(worker_id, _duet(
            "engine", kind, "--model", str(self.model), "--port", str(port), "--worker-id", worker_id,
            "--device", "cpu", "--page-size", str(lim.page_size), "--kv-cache-tokens", str(lim.kv_cache_tokens),
            "--max-num-seqs", str(lim.max_num_seqs), "--max-num-batched-tokens", str(lim.max_num_batched_tokens),
            *extra,
        ), env={"OMP_NUM_THREADS": str(lim.torch_threads), "MKL_NUM_THREADS": str(lim.torch_threads)})

    def pool_manager(self, should_stop):
        """A duet.pool_manager.PoolManager over this stack's workers (the planner stack); a switch stops
        and starts workers through the supervisor."""
        from duet.pool_manager import pool_manager_for

        return pool_manager_for(self.url, ADMIN_KEY, self.slots, self.supervisor, self.start_worker, should_stop)

    def workers(self, url: str | None = None) -> list[dict]:
        """A gateway's view of its workers (GET /admin/workers); [] while it is not answering."""
        req = urllib.request.Request((url or self.url) + "/admin/workers",
                                     headers={"authorization": f"Bearer {ADMIN_KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())["workers"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return []
