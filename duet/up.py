"""`duet up`: the whole stack as one foreground process tree.

Starts N `duet engine paged` and M `duet engine prefix` workers (or `duet engine sim` workers with
--sim) and one `duet gateway --config` as child processes on the default real model (pulled on first
use; the tiny random model if that fails) unless --model. The API opens only when a worker of each kind
it started is ready: the gateway (and `duet lb`) start then, and until then stdout says what it waits for
(duet/startup_watch.py). It waits until the gateway sees every worker it started healthy, prints the API
and dashboard URLs, and runs until Ctrl-C / SIGTERM. With --gateways N, N gateway replicas share Redis
behind `duet lb` on the one port (duet/scale_out.py). With --workers N
the workers' kinds follow the gateway's pool planner: duet/pool_manager.py drains a worker and `duet up`
restarts it as the other kind on the same port.

The children are supervised (duet/supervisor.py): one that exits is restarted with backoff, one that
crash-loops is reported and left down, and the stack itself ends only when every gateway has
crash-looped. A child that exits while the stack starts ends it at once, with its log (a bad model or
flag should not be retried).

The dashboard and admin API need an admin key: --admin-key or DUET_ADMIN_KEY, else a random one made
for this run. It reaches the gateway through its environment (never a command line `ps` shows) and is
printed next to the dashboard URL when it was generated.

No orphans: each child runs in its own process group (so Ctrl-C reaches only `duet up`, which
shuts the children down: SIGTERM to each group, workers drain, SIGKILL after a grace period) and asks
the kernel for SIGTERM should `duet up` itself die (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from duet import scale_out
from duet.launcher import (
    Launcher,
    SimOptions,
    StackError,
    WorkerSpec,
    free_port,
    gateway_config,
    healthy_workers,
)
from duet.startup_watch import StartupWatch
from duet.supervisor import Event, RestartPolicy

SHUTDOWN_GRACE_S = 20.0
UP_CAPTURE_RECORDS = 50_000  # the traffic capture `duet up` keeps (gateway/control/capture.py), about 10 MB of short prompts


def _say(message: str, **kw) -> None:
    print(f"duet up: {message}", file=sys.stderr, flush=True, **kw)


def _report(event: Event) -> None:
    _say(event.message)


@dataclass(frozen=True)
class _Plan:
    """What `duet up` was asked to run, settled before anything starts."""

    model: Path
    host: str
    port: int
    paged: int
    prefix: int
    gateways: int
    admin_key: str
    admin_key_given: bool
    threads: int  # torch threads per real worker
    backends: tuple[dict, ...] = ()  # --backend entries, as the gateway config's `backends`
    dtype: str | None = None  # what every real worker computes in (None: the directory's own: auto on CUDA)

    @property
    def workers(self) -> int:
        return self.paged + self.prefix

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    @property
    def gateway_names(self) -> list[str]:
        return ["gateway"] if self.gateways == 1 else [f"gateway-{i}" for i in range(self.gateways)]


def _plan(args: argparse.Namespace) -> _Plan | int:
    """The plan, or an exit code after saying what is wrong."""
    from duet.model_pull import PullError, resolve_model
    from gateway.backends.backend_spec import DEFAULT_KIND, BackendSpecError, parse_backend_flag

    try:
        from duet.auto_dtype import describe, resolve_dtype

        requested = getattr(args, "dtype", "auto")
        dtype = resolve_dtype(requested, getattr(args, "device", "cpu"))
        _say(describe(requested, dtype))
        model = resolve_model(args.model, dtype or "float32", _say)
    except PullError as exc:
        print(f"duet up: {exc}", file=sys.stderr)
        return 2
    try:
        backends = [parse_backend_flag(f) for f in getattr(args, "backend", None) or ()]
    except BackendSpecError as exc:
        print(f"duet up: {exc}", file=sys.stderr)
        return 2
    backends = [dict(b, kind=b["kind"] or DEFAULT_KIND[b["engine"]]) for b in backends]
    served = {b["kind"] for b in backends}  # an external pool replaces Duet's
    paged = args.paged if args.paged is not None else (0 if "paged" in served else 1)
    prefix = args.prefix if args.prefix is not None else (0 if "prefix" in served else 1)
    planned = getattr(args, "workers", None)
    if planned is not None:
        if planned < 1:
            print("duet up: --workers must be >= 1", file=sys.stderr)
            return 2
        paged, prefix = planned - planned // 2, planned // 2
    if getattr(args, "tensor_parallel_size", 1) < 1:
        print("duet up: --tensor-parallel-size must be >= 1", file=sys.stderr)
        return 2
    given_key = getattr(args, "admin_key", None) or os.environ.get("DUET_ADMIN_KEY")
    # each worker gets its share of the cores: more busy torch threads than cores stall every parallel op
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, paged + prefix))
    return _Plan(model, args.host, args.port, paged, prefix, getattr(args, "gateways", 1),
                 given_key or secrets.token_urlsafe(24), bool(given_key), threads, tuple(backends), dtype)


class _Up:
    """The steps of one `duet up` run over one Launcher."""

    def __init__(self, args: argparse.Namespace, plan: _Plan, launcher: Launcher) -> None:
        self.args, self.plan, self.launcher = args, plan, launcher
        self.slots: list[tuple[str, str, int]] = []  # (worker id, kind, port) per worker, in start order
        self.metrics_ports: dict[str, int] = {}  # real engine workers' Prometheus ports, kept across restarts
        self.gateway_ports: list[int] = []
        self.stop_signal: int | None = None
        self.gateways_down = False
        self.ready_by: float | None = None  # time.monotonic() by which the stack must be ready (--ready-timeout)
        # the workers' readiness, said on stdout while `duet up` waits
        self.watch = StartupWatch(plan.model.name, bool(args.sim), lambda line: print(f"duet up: {line}", flush=True))

    def catch_signals(self) -> None:
        def on_signal(signum, frame) -> None:
            self.stop_signal = signum

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def start_worker(self, worker_id: str, kind: str, port: int) -> None:
        """One worker (also the pool manager's way to start one as another kind on the same port)."""
        a, model = self.args, self.plan.model
        if a.sim:
            spec = WorkerSpec("sim", model, port, worker_id,
                              sim=SimOptions(as_kind=kind, ms_per_token=a.sim_ms_per_token,
                                             load_s=getattr(a, "sim_load_s", None) or None))
        else:
            metrics_port = self.metrics_ports.setdefault(worker_id, free_port())
            extra = shlex.split(getattr(a, f"{kind}_args", None) or "")
            spec = WorkerSpec(kind, model, port, worker_id, device=a.device, threads=self.plan.threads,
                              dtype=self.plan.dtype,
                              tensor_parallel_size=getattr(a, "tensor_parallel_size", 1),
                              metrics_port=metrics_port, extra_args=tuple(extra))
        self.launcher.start_worker(worker_id, spec)

    def start_workers(self) -> None:
        for kind, count in (("paged", self.plan.paged), ("prefix", self.plan.prefix)):
            for i in range(count):
                port = free_port()
                self.start_worker(f"{kind}-{i}", kind, port)
                self.slots.append((f"{kind}-{i}", kind, port))
                self.watch.add(f"{kind}-{i}", kind, port)

    def start_gateways(self, redis_url: str | None) -> None:
        """One gateway on the public port, or N replicas on private ports behind `duet lb` on it."""
        p = self.plan
        # the traffic capture is on in `duet up` (bounded: the newest UP_CAPTURE_RECORDS requests), off in a
        # `duet gateway` config unless asked for
        extra: dict = {"capture": {"enabled": not getattr(self.args, "no_capture", False),
                                   "max_records": UP_CAPTURE_RECORDS}}
        if getattr(self.args, "pool_planner", None):
            extra["pool_planner"] = json.loads(self.args.pool_planner)
        if redis_url:
            extra["redis"] = redis_url
        if p.backends:
            extra["backends"] = list(p.backends)
        addresses = [f"127.0.0.1:{port}" for _, _, port in self.slots]
        self.gateway_ports = scale_out.gateway_ports(p.gateways, p.port, free_port)
        host = p.host if p.gateways == 1 else "127.0.0.1"
        for name, port in zip(p.gateway_names, self.gateway_ports, strict=True):
            self.launcher.start_gateway(name, gateway_config(p.model, addresses, port=port, host=host, **extra),
                                        env={"DUET_ADMIN_KEY": p.admin_key})
        if p.gateways > 1:
            self.launcher.start_balancer(p.host, p.port, self.gateway_ports)

    def shared_redis(self) -> str | None:
        """--redis, or a private redis-server when gateway replicas must share state (duet/scale_out.py)."""
        if self.plan.gateways > 1 and not self.args.redis:
            return self.launcher.start_redis()
        return self.args.redis

    def announce(self) -> None:
        p = self.plan
        print(f"duet up: {p.paged} paged + {p.prefix} prefix {'sim ' if self.args.sim else ''}workers on "
              f"{p.model.name}" + "".join(f", {b['engine']} {b['url']} as a {b['kind']} pool" for b in p.backends) + (f", {p.gateways} gateways behind duet lb" if p.gateways > 1 else "") +
              f"; logs in {self.launcher.log_dir}", flush=True)

    def wait_workers(self) -> int | None:
        """None once a worker of each kind started can answer (the API may open), else the exit code."""
        def each_kind_ready() -> bool:
            self.watch.poll()  # says on stdout what changed
            return self.watch.each_kind_ready()

        code = self._wait(each_kind_ready, "no worker of each kind ready")
        if code is None and self.plan.workers:
            print("duet up: opening the API", flush=True)
        return code

    def wait_ready(self) -> int | None:
        """None once every gateway (and the balancer's port) sees every worker healthy, else the exit code."""
        p = self.plan
        urls = [p.url] if p.gateways == 1 else [*(f"http://127.0.0.1:{port}" for port in self.gateway_ports), p.url]
        # an external backend is not waited for past the first (the gateway serves what it has)
        need = p.workers or (1 if p.backends else 0)

        def ready() -> bool:
            self.watch.poll()  # the workers still loading, said as they become ready
            return all(healthy_workers(u) >= need for u in urls)

        return self._wait(ready, "not ready")

    def _wait(self, ready: Callable[[], bool], what: str) -> int | None:
        """Wait for `ready` within what is left of --ready-timeout (one budget for every step of the start)."""
        if self.ready_by is None:
            self.ready_by = time.monotonic() + self.args.ready_timeout
        try:
            done = self.launcher.wait_until(ready, max(0.0, self.ready_by - time.monotonic()), what,
                                            abort=lambda: self.stop_signal is not None)
        except StackError as exc:  # a bad flag or model: fail fast, with its log
            _say(str(exc))
            return 1
        return None if done else 130

    def print_urls(self) -> None:
        p = self.plan
        shown_key = "as given (--admin-key / DUET_ADMIN_KEY)" if p.admin_key_given else p.admin_key
        print(f"API:       {p.url}/v1\nDashboard: {p.url}/dashboard  (admin key: {shown_key})\n"
              f"Metrics:   {p.url}/metrics", flush=True)
        if self.metrics_ports:  # each engine worker's own metrics, for a Prometheus to scrape (sims have none)
            print("Worker metrics: " + " ".join(f"{w} http://127.0.0.1:{port}/metrics"
                                               for w, port in self.metrics_ports.items()), flush=True)
        print("Ctrl-C to stop.", flush=True)

    def should_stop(self) -> bool:
        """Supervise once. From here on a child that exits is restarted (its streams end with an error event
        at the gateway, which retries requests not yet streaming elsewhere); only when every gateway has
        crash-looped does the stack end, since nothing can be served without one."""
        sup = self.launcher.supervisor
        for event in sup.poll():
            if event.kind == "gave_up":
                print(sup.log_tail(event.name), file=sys.stderr, flush=True)
                self.gateways_down |= set(self.plan.gateway_names) <= set(sup.given_up())
        return self.stop_signal is not None or self.gateways_down

    def serve(self) -> int:
        """Until Ctrl-C / SIGTERM (0) or every gateway has crash-looped (1)."""
        if getattr(self.args, "workers", None) is not None:  # the pool manager polls should_stop while it waits
            import logging

            from duet.pool_manager import pool_manager_for

            logging.basicConfig(level=logging.INFO, format="duet up: %(message)s")  # each switch, one line
            pool_manager_for(self.plan.url, self.plan.admin_key, self.slots, self.launcher.supervisor,
                             self.start_worker, self.should_stop).run()
        while not self.should_stop():
            time.sleep(0.2)
        return 1 if self.gateways_down else 0


def main(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if isinstance(plan, int):
        return plan
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="duet-up-")), RestartPolicy(stop_grace_s=SHUTDOWN_GRACE_S),
                        on_event=_report)
    up = _Up(args, plan, launcher)
    up.catch_signals()
    try:
        redis_url = up.shared_redis()
        up.start_workers()
        up.announce()
        if (code := up.wait_workers()) is not None:
            return code
        up.start_gateways(redis_url)
        if (code := up.wait_ready()) is not None:
            return code
        up.print_urls()
        return up.serve()
    finally:
        print("duet up: shutting down", flush=True)
        up.watch.close()
        launcher.shutdown()
