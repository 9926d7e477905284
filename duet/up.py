"""`duet up`: the whole stack as one foreground process tree.

Starts N `duet engine paged` and M `duet engine prefix` workers (or `duet engine sim` workers with
--sim) and one `duet gateway --config` as child processes on the default real model (pulled on first
use; the tiny random model if that fails) unless --model, waits until the gateway sees every worker it
started healthy, prints the API and dashboard URLs, and runs until Ctrl-C / SIGTERM. With --gateways N,
N gateway replicas share Redis behind `duet lb` on the one port (duet/scale_out.py). With --workers N
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
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from duet import scale_out
from duet.supervisor import Event, RestartPolicy, Supervisor

SHUTDOWN_GRACE_S = 20.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _duet(*args: str) -> list[str]:
    return [sys.executable, "-m", "duet.cli", *args]


def _report(event: Event) -> None:
    print(f"duet up: {event.message}", file=sys.stderr, flush=True)


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
    stack = Supervisor(log_dir, RestartPolicy(stop_grace_s=SHUTDOWN_GRACE_S), on_event=_report)
    stop = {"signal": None}

    def on_signal(signum, frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host = args.host
    given_key = getattr(args, "admin_key", None) or os.environ.get("DUET_ADMIN_KEY")
    admin_key = given_key or secrets.token_urlsafe(24)
    addresses = []
    gateways = getattr(args, "gateways", 1)
    redis_url = args.redis
    planned = getattr(args, "workers", None)
    if planned is not None:
        if planned < 1:
            print("duet up: --workers must be >= 1", file=sys.stderr)
            return 2
        args.paged, args.prefix = planned - planned // 2, planned // 2
    slots: list[tuple[str, str, int]] = []  # (worker id, kind, port) per worker, in start order
    # each worker gets its share of the cores: more busy torch threads than cores stall every parallel op
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, args.paged + args.prefix))

    def start_worker(worker_id: str, kind: str, port: int) -> None:
        common = ["--model", str(model), "--port", str(port), "--worker-id", worker_id]
        if args.sim:
            stack.start(worker_id, _duet("engine", "sim", *common, "--sim-as", kind,
                                         "--sim-ms-per-token", str(args.sim_ms_per_token)))
        else:
            stack.start(worker_id, _duet("engine", kind, *common, "--device", args.device, "--threads", str(threads),
                                         "--tensor-parallel-size", str(getattr(args, "tensor_parallel_size", 1))))

    try:
        if gateways > 1 and not redis_url:  # replicas share state: a private redis-server (duet/scale_out.py)
            redis_port = _free_port("127.0.0.1")
            stack.start("redis", scale_out.redis_server_command(redis_port))
            scale_out.wait_for_redis(redis_port)
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
        for kind, count in (("paged", args.paged), ("prefix", args.prefix)):
            for i in range(count):
                port = _free_port("127.0.0.1")
                start_worker(f"{kind}-{i}", kind, port)
                slots.append((f"{kind}-{i}", kind, port))
                addresses.append(f"127.0.0.1:{port}")
        config = {"host": host, "port": args.port, "models": [{"path": str(model)}],
                  "workers": [{"address": a} for a in addresses], "health": {"poll_interval_s": 0.5}}
        if getattr(args, "pool_planner", None):
            config["pool_planner"] = json.loads(args.pool_planner)
        if redis_url:
            config["redis"] = redis_url
        gateway_ports = scale_out.gateway_ports(gateways, args.port, _free_port)
        for i, port in enumerate(gateway_ports):
            name = "gateway" if gateways == 1 else f"gateway-{i}"
            config_path = log_dir / f"{name}.yaml"
            config_path.write_text(yaml.safe_dump({**config, "port": port} if gateways == 1 else
                                                  {**config, "host": "127.0.0.1", "port": port}))
            stack.start(name, _duet("gateway", "--config", str(config_path)), env={"DUET_ADMIN_KEY": admin_key})
        gateway_names = ["gateway"] if gateways == 1 else [f"gateway-{i}" for i in range(gateways)]
        if gateways > 1:
            stack.start("lb", _duet(*scale_out.balancer_args(host, args.port, gateway_ports)))
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{args.port}"
        print(f"duet up: {args.paged} paged + {args.prefix} prefix {'sim ' if args.sim else ''}workers on "
              f"{model.name}" + (f", {gateways} gateways behind duet lb" if gateways > 1 else "") +
              f"; logs in {log_dir}", flush=True)
        deadline = time.monotonic() + args.ready_timeout
        must_be_ready = [url] if gateways == 1 else [*(f"http://127.0.0.1:{p}" for p in gateway_ports), url]
        while not all(_all_healthy(u, args.paged + args.prefix) for u in must_be_ready):
            if stop["signal"] is not None:
                return 130
            if exited := [n for n in stack.names() if stack.pid(n) is None]:  # a bad flag or model: fail fast
                print(f"duet up: {exited[0]} exited while starting:\n{stack.log_tail(exited[0])}",
                      file=sys.stderr, flush=True)
                return 1
            if time.monotonic() > deadline:
                print(f"duet up: not ready after {args.ready_timeout:.0f}s; logs in {log_dir}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        shown_key = "as given (--admin-key / DUET_ADMIN_KEY)" if given_key else admin_key
        print(f"API:       {url}/v1\nDashboard: {url}/dashboard  (admin key: {shown_key})\n"
              f"Metrics:   {url}/metrics\nCtrl-C to stop.", flush=True)
        # from here on a child that exits is restarted (its streams end with an error event at the
        # gateway, which retries requests not yet streaming elsewhere); only when every gateway has
        # crash-looped does the stack end, since nothing can be served without one
        fatal = {"gateways_down": False}

        def should_stop() -> bool:
            for event in stack.poll():
                if event.kind == "gave_up":
                    print(stack.log_tail(event.name), file=sys.stderr, flush=True)
                    fatal["gateways_down"] |= set(gateway_names) <= set(stack.given_up())
            return stop["signal"] is not None or fatal["gateways_down"]

        if planned is not None:  # the pool manager polls should_stop (and so the supervisor) while it waits
            import logging

            from duet.pool_manager import pool_manager_for

            logging.basicConfig(level=logging.INFO, format="duet up: %(message)s")  # each switch, one line
            pool_manager_for(url, admin_key, slots, stack, start_worker, should_stop).run()
        while not should_stop():
            time.sleep(0.2)
        return 1 if fatal["gateways_down"] else 0
    finally:
        print("duet up: shutting down", flush=True)
        stack.shutdown()
