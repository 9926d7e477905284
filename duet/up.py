"""`duet up`: the whole stack as one foreground process tree.

Starts N `duet engine paged` and M `duet engine prefix` workers (or `duet engine sim` workers with
--sim) and one `duet gateway --config` as child processes on the default real model (pulled
on first use; the tiny random model if that fails) unless --model, waits until the gateway sees every
worker it started healthy, prints the API and
dashboard URLs, and runs until Ctrl-C / SIGTERM or until a child dies. With --gateways N, N gateway
replicas share Redis behind `duet lb` on the one port (duet/scale_out.py); one replica dying is survived.

The dashboard and admin API need an admin key: --admin-key or DUET_ADMIN_KEY, else a random one made
for this run. It reaches the gateway through its environment (never a command line `ps` shows) and is
printed next to the dashboard URL when it was generated.

No orphans: each child runs in its own process group (so Ctrl-C reaches only `duet up`, which
shuts the children down in order: SIGTERM to each group, workers drain, SIGKILL after a grace
period) and asks the kernel for SIGTERM should `duet up` itself die (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from duet import scale_out

SHUTDOWN_GRACE_S = 20.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: own process group, SIGTERM when the parent dies (Linux)."""
    os.setpgrp()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Stack:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.replicas: set[str] = set()  # gateway replicas: the stack lives while one of them does
        self._reported: set[str] = set()

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              program: list[str] | None = None) -> None:
        # preexec_fn is safe here: `duet up` runs no threads
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([*(program or [sys.executable, "-m", "duet.cli"]), *args], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent,  # noqa: PLW1509
                                    env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.children.append((name, proc))

    def dead(self) -> tuple[str, int] | None:
        """The first child whose death ends the stack. Gateway replicas behind `duet lb` are spares for
        each other: one dying is logged, the last one dying is fatal."""
        gone = {name: p.returncode for name, p in self.children if p.poll() is not None}
        for name in gone.keys() & self.replicas - self._reported:
            print(f"duet up: {name} exited with {gone[name]}; the other gateways serve", file=sys.stderr, flush=True)
            self._reported.add(name)
        for name, code in gone.items():
            if name not in self.replicas or self.replicas <= gone.keys():
                return name, code
        return None

    def tail(self, name: str, chars: int = 2000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def shutdown(self) -> None:
        # the gateway first (no new requests), then the workers (they drain what is in flight)
        for _, p in reversed(self.children):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for _, p in self.children:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in self.children:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever is left of the group, grandchildren too
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()


def _all_healthy(url: str, expected: int) -> bool:
    """The gateway sees `expected` healthy workers (its /ready alone says: at least one per model)."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return sum(body.get("healthy_workers", {}).values()) >= expected


def main(args: argparse.Namespace) -> int:
    from duet.model_pull import PullError, resolve_model

    def announce(message: str) -> None:
        print(f"duet up: {message}", file=sys.stderr, flush=True)

    try:
        model = resolve_model(args.model, getattr(args, "dtype", "float32"), announce)
    except PullError as exc:
        print(f"duet up: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="duet-up-"))
    stack = Stack(log_dir)
    stop = {"signal": None}

    def on_signal(signum, frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host = args.host
    given_key = getattr(args, "admin_key", None) or os.environ.get("DUET_ADMIN_KEY")
    admin_key = given_key or secrets.token_urlsafe(24)
    addresses = []
    # each worker gets its share of the cores: more busy torch threads than cores stall every parallel op
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, args.paged + args.prefix))
    gateways = getattr(args, "gateways", 1)
    redis_url = args.redis
    try:
        if gateways > 1 and not redis_url:  # replicas share state: a private redis-server (duet/scale_out.py)
            redis_port = _free_port("127.0.0.1")
            stack.spawn("redis", [], program=scale_out.redis_server_command(redis_port))
            scale_out.wait_for_redis(redis_port)
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
        for kind, count in (("paged", args.paged), ("prefix", args.prefix)):
            for i in range(count):
                port = _free_port("127.0.0.1")
                worker_id = f"{kind}-{i}"
                common = ["--model", str(model), "--port", str(port), "--worker-id", worker_id]
                if args.sim:
                    stack.spawn(worker_id, ["engine", "sim", *common, "--sim-as", kind,
                                            "--sim-ms-per-token", str(args.sim_ms_per_token)])
                else:
                    stack.spawn(worker_id, ["engine", kind, *common, "--device", args.device,
                                            "--threads", str(threads)])
                addresses.append(f"127.0.0.1:{port}")
        config = {"host": host, "port": args.port, "models": [{"path": str(model)}],
                  "workers": [{"address": a} for a in addresses], "health": {"poll_interval_s": 0.5}}
        if redis_url:
            config["redis"] = redis_url
        gateway_ports = scale_out.gateway_ports(gateways, args.port, _free_port)
        for i, port in enumerate(gateway_ports):
            name = "gateway" if gateways == 1 else f"gateway-{i}"
            config_path = log_dir / f"{name}.yaml"
            config_path.write_text(yaml.safe_dump({**config, "port": port} if gateways == 1 else
                                                  {**config, "host": "127.0.0.1", "port": port}))
            stack.spawn(name, ["gateway", "--config", str(config_path)], env={"DUET_ADMIN_KEY": admin_key})
        if gateways > 1:
            stack.replicas = {f"gateway-{i}" for i in range(gateways)}
            stack.spawn("lb", scale_out.balancer_args(host, args.port, gateway_ports))
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{args.port}"
        print(f"duet up: {args.paged} paged + {args.prefix} prefix {'sim ' if args.sim else ''}workers on "
              f"{model.name}" + (f", {gateways} gateways behind duet lb" if gateways > 1 else "") +
              f"; logs in {log_dir}", flush=True)
        deadline = time.monotonic() + args.ready_timeout
        must_be_ready = [url] if gateways == 1 else [*(f"http://127.0.0.1:{p}" for p in gateway_ports), url]
        while not all(_all_healthy(u, args.paged + args.prefix) for u in must_be_ready):
            if stop["signal"] is not None:
                return 130
            if (dead := stack.dead()) is not None:
                print(f"duet up: {dead[0]} exited with {dead[1]} while starting:\n{stack.tail(dead[0])}",
                      file=sys.stderr, flush=True)
                return 1
            if time.monotonic() > deadline:
                print(f"duet up: not ready after {args.ready_timeout:.0f}s; logs in {log_dir}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        shown_key = "as given (--admin-key / DUET_ADMIN_KEY)" if given_key else admin_key
        print(f"API:       {url}/v1\nDashboard: {url}/dashboard  (admin key: {shown_key})\n"
              f"Metrics:   {url}/metrics\nCtrl-C to stop.", flush=True)
        while stop["signal"] is None:
            if (dead := stack.dead()) is not None:
                print(f"duet up: {dead[0]} exited with {dead[1]}:\n{stack.tail(dead[0])}", file=sys.stderr,
                      flush=True)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        print("duet up: shutting down", flush=True)
        stack.shutdown()
