"""One engine worker process: a grpc.aio server with the Engine service, grpc.health.v1, a
Prometheus endpoint, and a drain on SIGTERM. Engine kinds call `run_worker` with a `build`
function that loads the model and returns their `EngineParts`.

Lifecycle:
  1. the server listens at once, health NOT_SERVING, Generate answers UNAVAILABLE;
  2. `build()` runs in a thread (loading weights never blocks the event loop); then SERVING;
  3. SIGTERM/SIGINT: health NOT_SERVING, new requests refused (UNAVAILABLE), requests in flight
     finish for up to `drain_timeout` seconds (the rest are aborted), the server stops, exit 0.

With `redis_url` the worker registers itself for the gateways' discovery once SERVING (duet/registry.py:
a heartbeated key with its address, kind, model and version) and deletes the entry first thing on drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from duet.engine_config import EngineConfig
from duet.registry import Registration, advertised_address, worker_info
from duet.rpc import engine_pb2, engine_pb2_grpc
from engine_core.metrics import EngineMetrics
from engine_core.request import EngineSpec
from engine_core.scheduler_protocol import Runner, Scheduler
from engine_core.servicer import EngineServicer
from engine_core.step_loop import StepLoop

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name  # "duet.engine.v1.Engine"


@dataclass
class EngineParts:
    """What an engine kind provides: its scheduler, the model runner, and what GetInfo reports."""

    scheduler: Scheduler
    runner: Runner
    spec: EngineSpec


class Worker:
    def __init__(self, build: Callable[[], EngineParts], *, host: str = "127.0.0.1", port: int = 0,
                 drain_timeout: float = 30.0, metrics_port: int | None = None, max_pending: int = 4096,
                 tracer_provider=None, redis_url: str | None = None) -> None:
        self.build = build
        self.host, self.port = host, port
        self.drain_timeout = drain_timeout
        self.metrics_port = metrics_port
        self.max_pending = max_pending
        self.redis_url = redis_url
        self.registration: Registration | None = None
        self.servicer = EngineServicer(tracer_provider)  # None: the process's global provider
        self.health = health.aio.HealthServicer()
        self.step_loop: StepLoop | None = None
        self.metrics: EngineMetrics | None = None
        self.ready = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _build(self) -> EngineParts:
        """The engine, built on a thread of its own; that thread's OpenMP team is freed before the step loop,
        another thread, starts one (engine_core/threads.py says why)."""
        from engine_core.threads import release_openmp_team

        parts = self.build()
        release_openmp_team()
        return parts

    async def start(self) -> int:
        """Listen (NOT_SERVING), load the engine, turn SERVING. Returns the bound port."""
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        engine_pb2_grpc.add_EngineServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        await self._set_health(False)
        await self._server.start()
        log.info("listening on %s:%d, loading", self.host, self.port)
        parts = await asyncio.to_thread(self._build)
        self.metrics = EngineMetrics(parts.spec.engine_kind, parts.spec.model_id)
        if self.metrics_port is not None:
            self.metrics.serve(self.metrics_port)
        self.step_loop = StepLoop(parts.scheduler, parts.runner, metrics=self.metrics, max_pending=self.max_pending)
        self.step_loop.start()
        self.servicer.attach(self.step_loop, parts.spec)
        await self._set_health(True)
        if self.redis_url:
            spec = parts.spec
            self.registration = Registration(self.redis_url, worker_info(
                spec.worker_id, advertised_address(self.host, self.port), spec.engine_kind, spec.model_id,
                spec.version))
            self.registration.start()
        self.ready.set()
        log.info("serving %s (%s) on port %d", parts.spec.model_id, parts.spec.engine_kind, self.port)
        return self.port

    def request_stop(self) -> None:
        self._stop.set()

    async def shutdown(self) -> bool:
        """Drain and stop. True when every request in flight finished within the timeout."""
        if self.registration is not None:  # gateways stop sending new work before the drain
            await self.registration.stop()
            self.registration = None
        await self._set_health(False)
        clean = True
        if self.step_loop is not None:
            clean = await self.step_loop.drain(self.drain_timeout)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.step_loop is not None:
            self.step_loop.stop()
        return clean

    async def serve_until_signal(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        start = asyncio.create_task(self.start())
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and start.exception() is not None:
            stop.cancel()
            raise start.exception()
        await stop
        if not start.done():  # stopped while loading
            start.cancel()
        clean = await self.shutdown()
        log.info("drained (%s), exiting", "clean" if clean else "timed out, requests aborted")
        return 0


def serve(config: EngineConfig, build: Callable[[], EngineParts]) -> int:
    """`duet engine paged|prefix`: a bad device or thread count fails before the port opens; then `run_worker`
    with the config's address, drain timeout, metrics port and registry."""
    from engine_core.builder import resolve_device
    from engine_core.threads import configure_torch_threads

    try:
        resolve_device(config.device)
        configure_torch_threads(config.threads)
    except ValueError as exc:  # DeviceError included
        raise SystemExit(f"duet engine: {exc}") from None
    return run_worker(build, host=config.host, port=config.port, drain_timeout=config.drain_timeout,
                      metrics_port=config.metrics_port, redis_url=config.redis)


def run_worker(build: Callable[[], EngineParts], *, host: str, port: int, drain_timeout: float,
               metrics_port: int | None, redis_url: str | None = None) -> int:
    """Blocking entry for `duet engine <kind>`; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = Worker(build, host=host, port=port, drain_timeout=drain_timeout, metrics_port=metrics_port,
                    redis_url=redis_url)
    return asyncio.run(worker.serve_until_signal())
