"""`duet up --gateways N`: the pieces that put several gateway replicas behind one port.

Gateways are stateless once their state lives in Redis (session affinity, canary configs, the worker
registry), so N replicas share one Redis: `--redis URL`, or a private `redis-server` from PATH started
as one more child of `duet up`. The replicas listen on free loopback ports and `duet lb`
(duet/balancer.py) listens on the port the user asked for.
"""

from __future__ import annotations

import shutil
import socket
import time


class ScaleOutError(RuntimeError):
    """Several gateways were asked for but cannot share state (no Redis)."""


def redis_server_command(port: int) -> list[str]:
    """A throwaway redis-server on loopback: no persistence, gone with `duet up`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ScaleOutError("--gateways > 1 needs shared state: pass --redis URL or put redis-server on PATH")
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--loglevel", "warning"]


def wait_for_redis(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise ScaleOutError(f"the local redis-server did not answer on port {port} within {timeout_s:.0f}s")


def gateway_ports(count: int, public_port: int, free_port) -> list[int]:
    """One gateway listens on the public port itself; several listen on free ports behind `duet lb`."""
    if count < 1:
        raise ScaleOutError("--gateways must be at least 1")
    return [public_port] if count == 1 else [free_port("127.0.0.1") for _ in range(count)]


def balancer_args(host: str, port: int, backend_ports: list[int]) -> list[str]:
    backends = [a for p in backend_ports for a in ("--backend", f"127.0.0.1:{p}")]
    return ["lb", "--host", host, "--port", str(port), "--health-interval", "0.5", *backends]
