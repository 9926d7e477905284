"""What `duet up` waits for while its workers start, said on stdout as it changes.

Each worker is probed on grpc.health.v1 directly (no gateway is needed yet): it is `starting` while its
port does not answer (the process imports), `loading` while it answers NOT_SERVING (the engine loads its
model), and `ready` once SERVING. `poll()` reads what the probes found and prints one line per change:

    duet up: waiting for paged-0 (engine_paged: loading SmolLM2-135M-Instruct)
    duet up: ready: paged-0 (engine_paged) after 12.4 s

`duet up` opens the API once `each_kind_ready()` (a worker of every kind it started can answer), so the
model `/v1/models` lists is one that answers; it prints the URLs once the gateway sees them all.

The probes run in a child process (`python -m duet.startup_watch PORT...`, one "PORT STAGE" line per change):
grpc must not run in `duet up` itself, which forks every worker and gateway, and a fork of a process with
grpc's threads running can break the child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

STARTING, LOADING, READY = "starting", "loading", "ready"
PROBE_INTERVAL_S = 0.2


@dataclass
class _Watched:
    name: str
    kind: str
    label: str  # "engine_paged", or "sim as paged"
    stage: str = ""


class StartupWatch:
    def __init__(self, model_name: str, sim: bool, say: Callable[[str], None]) -> None:
        self._model_name, self._sim, self._say = model_name, sim, say
        self._started = time.monotonic()
        self._workers: dict[int, _Watched] = {}  # by port
        self._prober: subprocess.Popen | None = None
        self._unread = b""

    def add(self, name: str, kind: str, port: int) -> None:
        """A worker `duet up` started on 127.0.0.1:`port` (before the first `poll`)."""
        self._workers[port] = _Watched(name, kind, f"sim as {kind}" if self._sim else f"engine_{kind}")

    def poll(self) -> None:
        if not self._workers:
            return
        if self._prober is None:
            from duet.supervisor import ask_for_parent_death_signal

            # a session of its own: Ctrl-C reaches `duet up`, which ends it; so does `duet up`'s death
            # (preexec_fn is safe: `duet up` runs no threads)
            self._prober = subprocess.Popen([sys.executable, "-m", "duet.startup_watch", *map(str, self._workers)],
                                            stdout=subprocess.PIPE, start_new_session=True,
                                            preexec_fn=ask_for_parent_death_signal)  # noqa: PLW1509
            os.set_blocking(self._prober.stdout.fileno(), False)
        try:
            self._unread += os.read(self._prober.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return
        *lines, self._unread = self._unread.split(b"\n")
        for line in lines:
            port, stage = line.decode().split()
            self._set(self._workers[int(port)], stage)

    def each_kind_ready(self) -> bool:
        ready = {w.kind for w in self._workers.values() if w.stage == READY}
        return ready == {w.kind for w in self._workers.values()}

    def close(self) -> None:
        if self._prober is not None and self._prober.poll() is None:
            self._prober.kill()
            self._prober.wait()

    def _set(self, w: _Watched, stage: str) -> None:
        w.stage = stage
        if stage == READY:
            self._say(f"ready: {w.name} ({w.label}) after {time.monotonic() - self._started:.1f} s")
        else:
            doing = f"loading {self._model_name}" if stage == LOADING else "starting"
            self._say(f"waiting for {w.name} ({w.label}: {doing})")


def _probe_until_ready(ports: list[int]) -> None:
    """Print "PORT STAGE" whenever a worker's stage changes; return once every worker is ready."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stubs = {p: health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{p}")) for p in ports}
    stages: dict[int, str] = {}
    while any(stages.get(p) != READY for p in ports):
        for port, stub in stubs.items():
            if stages.get(port) == READY:
                continue
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                stage = READY if reply.status == health_pb2.HealthCheckResponse.SERVING else LOADING
            except grpc.RpcError:
                stage = STARTING
            if stages.get(port) != stage:
                stages[port] = stage
                print(port, stage, flush=True)
        time.sleep(PROBE_INTERVAL_S)


if __name__ == "__main__":
    _probe_until_ready([int(p) for p in sys.argv[1:]])
