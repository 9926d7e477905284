"""`duet lb`: a small TCP load balancer for several gateway replicas behind one port (no torch).

    duet lb --port 8000 --backend 127.0.0.1:8101 --backend 127.0.0.1:8102

Each client connection goes to the next live backend, round robin. A backend is live while its
`GET /health` answers 200 (checked every `--health-interval` seconds) and until a connect to it fails.

Why a request is not lost when a gateway dies: until the backend has sent its first byte back, the
balancer keeps a copy of what the client sent on the connection. If the backend refuses the connect,
resets, or closes before answering, the balancer opens a connection to another live backend and
replays the copy there; the client sees nothing. Once a response has started (the gateway sends its
headers only after the engine's first token) the bytes are streaming and cannot be replayed, so
a backend that dies then closes the client's connection. A keep-alive connection's later requests are
in the same position: after the first response the connection is pinned to its backend.

Gateways hold no state of their own that a replay could miss: affinity, canary weights and the
worker registry live in Redis, so any replica routes a session's request to the same worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

log = logging.getLogger("duet.lb")

READ_CHUNK = 64 * 1024
MAX_REPLAY_BYTES = 8 * 1024 * 1024  # a request body bigger than this is not replayed (gateway limit is 4 MiB)


@dataclass
class Backend:
    host: str
    port: int
    live: bool = True

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Connection:
    """One client connection's replay state."""

    sent: bytearray = field(default_factory=bytearray)  # the client's bytes while replayable
    replayable: bool = True  # no byte has come back yet (and the request fit MAX_REPLAY_BYTES)
    client_eof: bool = False


def parse_backend(text: str) -> Backend:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"backend must be host:port, got {text!r}")
    return Backend(host, int(port))


class Balancer:
    def __init__(self, backends: list[Backend], *, connect_timeout_s: float = 2.0,
                 health_interval_s: float = 1.0) -> None:
        if not backends:
            raise ValueError("at least one backend is needed")
        self.backends = backends
        self.connect_timeout_s = connect_timeout_s
        self.health_interval_s = health_interval_s
        self._next = 0
        self.replays = 0  # connections moved to another backend before any byte came back

    def candidates(self) -> list[Backend]:
        """Backends in the order to try for a new connection: live ones round robin, then the rest
        (a backend marked down may be back before its next health check)."""
        live = [b for b in self.backends if b.live]
        start, self._next = self._next % max(1, len(live)), self._next + 1
        return live[start:] + live[:start] + [b for b in self.backends if not b.live]

    async def _connect(self, tried: set[str]):
        for b in self.candidates():
            if b.name in tried:
                continue
            tried.add(b.name)
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), self.connect_timeout_s)
                return b, r, w
            except (TimeoutError, OSError) as e:
                if b.live:
                    log.warning("backend %s down: connect failed (%s)", b.name, e)
                b.live = False
        return None

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Connection()
        tried: set[str] = set()
        try:
            while (picked := await self._connect(tried)) is not None:
                backend, r, w = picked
                if conn.sent:
                    w.write(bytes(conn.sent))
                    self.replays += 1
                if not await self._pipe(client_r, client_w, r, w, conn):
                    return
                if conn.sent:  # it took a request and closed without a byte: it is going away
                    backend.live = False
                    log.warning("backend %s down: closed before answering; replaying on another", backend.name)
            # no backend took the connection: close it (the client sees a closed connection, not a hang)
        finally:
            with contextlib.suppress(Exception):
                client_w.close()
                await client_w.wait_closed()

    async def _pipe(self, client_r, client_w, r, w, conn: _Connection) -> bool:
        """Copy bytes both ways until the backend closes. True when it closed before its first byte
        and the connection can be replayed elsewhere (`conn.sent` holds all the client sent)."""

        async def upstream() -> None:
            if not conn.client_eof:
                while data := await client_r.read(READ_CHUNK):
                    if conn.replayable:
                        if len(conn.sent) + len(data) > MAX_REPLAY_BYTES:
                            conn.replayable = False
                            conn.sent.clear()
                        else:
                            conn.sent.extend(data)
                    w.write(data)
                    await w.drain()
                conn.client_eof = True
            if w.can_write_eof():
                w.write_eof()

        async def downstream() -> None:
            while data := await r.read(READ_CHUNK):
                conn.replayable = False  # the response has started: from here on it streams
                conn.sent.clear()
                client_w.write(data)
                await client_w.drain()

        up = asyncio.create_task(upstream())
        try:
            with contextlib.suppress(ConnectionError, OSError):
                await downstream()
        finally:
            up.cancel()
            with contextlib.suppress(BaseException):
                await up
            with contextlib.suppress(Exception):
                w.close()
        nothing_to_send = conn.client_eof and not conn.sent
        return conn.replayable and not nothing_to_send

    async def check(self, b: Backend) -> None:
        """One health probe: `GET /health` over a fresh connection; 200 keeps (or makes) it live."""
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), self.connect_timeout_s)
            try:
                w.write(f"GET /health HTTP/1.1\r\nHost: {b.name}\r\nConnection: close\r\n\r\n".encode())
                line = await asyncio.wait_for(r.readline(), self.connect_timeout_s)
            finally:
                w.close()
            ok = line.split()[1:2] == [b"200"]
        except (TimeoutError, OSError, IndexError):
            ok = False
        if ok != b.live:
            log.warning("backend %s is %s", b.name, "up" if ok else "down")
        b.live = ok

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(b) for b in self.backends))
            await asyncio.sleep(self.health_interval_s)

    async def serve(self, host: str, port: int, started: asyncio.Event | None = None) -> None:
        server = await asyncio.start_server(self.handle, host, port, limit=READ_CHUNK)
        health = asyncio.create_task(self.health_loop())
        log.info("balancing %s on %s:%d", ", ".join(b.name for b in self.backends), host, port)
        if started is not None:
            started.set()
        try:
            async with server:
                await server.serve_forever()
        finally:
            health.cancel()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        backends = [parse_backend(b) for b in args.backend]
        balancer = Balancer(backends, connect_timeout_s=args.connect_timeout,
                            health_interval_s=args.health_interval)
    except ValueError as e:
        print(f"duet lb: {e}")
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_until_signal(balancer, args.host, args.port))
    return 0


async def _serve_until_signal(balancer: Balancer, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT. Handlers are needed: as PID 1 in a container, a signal without
    one is ignored and the container would only die by SIGKILL."""
    serving = asyncio.create_task(balancer.serve(host, port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, serving.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await serving
