"""A serving stack for a benchmark: N engine workers and one or more gateways as child processes.

`ServingStack(model, kinds, routing, ...)` is a context manager: on entry it starts one
`duet engine KIND` per entry of `kinds` (each on a free port, the same page size, KV budget and
batch limits, one torch thread each so that workers do not fight over the cores), then
`gateways` × `duet gateway --config` with the given `routing` section (and `gateway_extra` keys,
e.g. a shared `redis` and `timeouts`), and waits until every gateway sees every worker healthy (its
/admin/workers, not just /ready, which needs only one). The children run under a
`duet.supervisor.Supervisor` (`self.supervisor`, for drills that kill and restart them) of the one
stack launcher (duet/launcher.py, which also starts `duet up`); on exit it stops them all (SIGTERM,
drain, SIGKILL after a grace period). A child that dies while starting raises `StackError` with the
tail of its log. `cpus` pins worker i to the cores `cpus[i]` and `gateway_cpus` the gateways (taskset;
`duet bench compare --pin-cores`, `duet bench classes`); a worker restarted by the pool manager keeps its cores.
`worker_args[kind]` are more flags for every worker of that kind (`--engine-args KIND="FLAGS"` of `duet bench
classes` and `duet bench peer`, read by `kind_flags`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Self

from duet.launcher import (
    EngineLimits,
    Launcher,
    StackError,
    WorkerSpec,
    admin_workers,
    free_port,
    gateway_config,
)
from duet.supervisor import RestartPolicy

__all__ = ["ADMIN_KEY", "NO_DRAFTING", "EngineLimits", "ServingStack", "StackError", "free_port",
           "paged_prefix_caching_flags", "preset_checkpoint"]

ADMIN_KEY = "bench-admin"  # the stack is private to the benchmark: a fixed key is enough
DEFAULT_LIMITS = EngineLimits()
# worker_args for a stack whose prefix workers decode one token a step (engine_prefix drafts by default)
NO_DRAFTING = {"prefix": ("--speculative", "off")}


def kind_flags(items: list[str], kinds: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--engine-args` values, each KIND=FLAGS with KIND one of `kinds`, as (kind, flags) pairs in order."""
    pairs = []
    for item in items:
        kind, sep, flags = item.partition("=")
        if not sep or kind not in kinds:
            raise ValueError(f"--engine-args {item!r}: give KIND=FLAGS with KIND {', '.join(kinds)}")
        pairs.append((kind, flags))
    return tuple(pairs)


def paged_prefix_caching_flags() -> list[str]:
    """The flag a paged worker gets when its limits keep prefix caching on (duet.launcher.worker_argv
    passes it, or --no-enable-prefix-caching when they turn it off); `duet engine paged` has it."""
    return ["--enable-prefix-caching"]


def preset_checkpoint(preset: str) -> Path:
    """A random checkpoint of the preset's shape (timing depends on the shape, not the weights: the headline
    uses SmolLM2-135M's), made once under the cache dir (DUET_CACHE_DIR overrides) and reused."""
    from duet.model_make import cached_model_dir

    return cached_model_dir(preset, "llama")


class ServingStack:
    def __init__(self, model: str | Path, kinds: list[str], routing: dict, limits: EngineLimits = DEFAULT_LIMITS,
                 ready_timeout_s: float = 300.0, log_dir: Path | None = None, gateways: int = 1,
                 gateway_extra: dict | None = None, policy: RestartPolicy | None = None,
                 pool_planner: dict | None = None, cpus: list[str] | None = None,
                 gateway_cpus: str | None = None, worker_args: dict[str, tuple[str, ...]] | None = None) -> None:
        if cpus is not None and len(cpus) != len(kinds):
            raise ValueError(f"{len(cpus)} core lists for {len(kinds)} workers")
        self.model = Path(model)
        self.kinds = list(kinds)
        self.routing = dict(routing)
        self.limits = limits
        self.ready_timeout_s = ready_timeout_s
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="duet-bench-"))
        self.launcher = Launcher(self.log_dir, policy)
        self.supervisor = self.launcher.supervisor
        self.num_gateways = gateways
        self.gateway_extra = dict(gateway_extra or {})
        self.url = ""
        self.urls: list[str] = []
        self.worker_addresses: dict[str, str] = {}  # worker id -> host:port
        self.pool_planner = pool_planner  # the gateway's planner settings (a stack with a pool manager)
        self.slots: list[tuple[str, str, int]] = []  # (worker id, kind, port)
        self.cpus = {f"{kind}-{i}": c for i, (kind, c) in enumerate(zip(kinds, cpus))} if cpus else {}
        self.gateway_cpus = gateway_cpus
        self.worker_args = dict(worker_args or {})  # kind -> more `duet engine KIND` flags

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.launcher.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.launcher.shutdown()

    def _start(self) -> None:
        # the gateways inherit the environment too; they have no torch, so the workers' thread count is enough
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ.update(OMP_NUM_THREADS=str(self.limits.torch_threads), MKL_NUM_THREADS=str(self.limits.torch_threads))
        try:
            for i, kind in enumerate(self.kinds):
                port = free_port()
                self.start_worker(f"{kind}-{i}", kind, port)
                self.slots.append((f"{kind}-{i}", kind, port))
                self.worker_addresses[f"{kind}-{i}"] = f"127.0.0.1:{port}"
            addresses = list(self.worker_addresses.values())
            for g in range(self.num_gateways):
                port = free_port()
                config = gateway_config(self.model, addresses, port=port,
                                        **{"auth": {"admin_key": ADMIN_KEY}, "routing": self.routing,
                                           **self.gateway_extra})
                if self.pool_planner is not None:
                    config["pool_planner"] = self.pool_planner
                self.launcher.start_gateway("gateway" if self.num_gateways == 1 else f"gateway-{g}", config,
                                            cpus=self.gateway_cpus)
                self.urls.append(f"http://127.0.0.1:{port}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.url = self.urls[0]

        def every_gateway_sees_every_worker() -> bool:
            views = [self.workers(u) for u in self.urls]
            want = len(self.kinds) + len(self.gateway_extra.get("backends", ()))  # external pools count too
            return all(len(rows) == want and all(r["healthy"] for r in rows) for rows in views)

        self.launcher.wait_until(every_gateway_sees_every_worker, self.ready_timeout_s,
                                 what="not every worker healthy", interval_s=0.25)

    def start_worker(self, worker_id: str, kind: str, port: int) -> None:
        self.launcher.start_worker(worker_id, WorkerSpec(kind, self.model, port, worker_id, device="cpu",
                                                         limits=self.limits, cpus=self.cpus.get(worker_id),
                                                         extra_args=tuple(self.worker_args.get(kind, ()))))

    def pool_manager(self, should_stop):
        """A duet.pool_manager.PoolManager over this stack's workers (the planner stack); a switch stops
        and starts workers through the supervisor."""
        from duet.pool_manager import pool_manager_for

        return pool_manager_for(self.url, ADMIN_KEY, self.slots, self.supervisor, self.start_worker, should_stop)

    def workers(self, url: str | None = None) -> list[dict]:
        """A gateway's view of its workers (GET /admin/workers); [] while it is not answering."""
        return admin_workers(url or self.url, ADMIN_KEY)
