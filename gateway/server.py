"""`duet gateway --config FILE`: load the config, build the app, serve it with uvicorn.

Logging (`--log-level`, INFO by default) keeps INFO for changes: the worker pool's polls are silent there
(gateway/backends/fleet.py logs what changes; each request to an HTTP backend, its polls included, is a DEBUG
line: gateway/backends/http_backend.py), and the gateway's own access lines are off.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

import uvicorn

from duet.model_dir import ModelDirError
from duet.tokenizer import TokenizerError
from gateway import gc_policy
from gateway.config import ConfigError, load, parse_api_keys
from gateway.ticks import tick_wait


def setup_tracing(enabled: bool):
    """With `tracing.enabled`, an SDK tracer provider that prints finished spans to stderr (an
    OpenTelemetry Collector can take them over OTLP when that exporter is installed)."""
    if not enabled:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    except ImportError:
        exporter = ConsoleSpanExporter(out=sys.stderr)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class QuietServer(uvicorn.Server):
    """uvicorn's server with its housekeeping tick once a second instead of ten times: uvicorn wakes its loop
    every 0.1 s to look for a shutdown signal and refreshes the `date` header every tenth tick. An idle gateway's
    loop woke ~17 times a second, ten of them this tick, and each wake of a process that slept costs ~0.15 ms of
    CPU on a 2-core machine (cold caches): a sixth of the gateway's CPU per request at 1 request/s
    (docs/benchmarks.md). Here the tick is the second the header needs, and a shutdown signal wakes it at once."""

    TICK_S = 1.0

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        loop, event = getattr(self, "_exit_loop", None), getattr(self, "_exit_event", None)
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)  # from a signal handler: the loop's own thread, any moment

    async def main_loop(self) -> None:
        self._exit_loop, self._exit_event = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):  # counter % 10 == 0 every time: the date header each tick
            counter = (counter + 10) % 864000
            try:  # to the next whole second, with the gateway's other periodic tasks (gateway/ticks.py)
                await asyncio.wait_for(self._exit_event.wait(), tick_wait(self.TICK_S))
            except TimeoutError:
                pass


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(args: argparse.Namespace) -> int:
    from gateway.app import build_app

    setup_logging(getattr(args, "log_level", None) or "info")
    try:
        config = load(args.config)
    except ConfigError as e:
        print(f"duet gateway: {e}", file=sys.stderr)
        return 2
    overrides = {}
    if getattr(args, "api_keys", None):
        overrides["api_keys"] = {**config.api_keys, **parse_api_keys([k for k in args.api_keys.split(",") if k])}
    if getattr(args, "admin_key", None):
        overrides["admin_key"] = args.admin_key
    config = dataclasses.replace(config, **overrides)
    try:
        app = build_app(config, tracer_provider=setup_tracing(config.tracing))
    except (ModelDirError, TokenizerError) as e:
        print(f"duet gateway: cannot load a model of {args.config}: {e}", file=sys.stderr)
        return 2
    # the app, its tokenizers and router are built and live as long as the process: the GC policy freezes them
    # and collects the requests' short-lived objects in larger batches (gateway/gc_policy.py says why)
    gc_policy.register_metrics(app.state.gateway.metrics.registry)
    gc_policy.apply(config.gc)
    # loop "auto" (uvicorn's default): uvloop, a dependency, where installed; asyncio's own loop cost the gateway
    # about a tenth more CPU per streamed request (docs/benchmarks.md)
    server = QuietServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                        access_log=False, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 3  # as uvicorn.run: 3 when it never served (the port taken, say)
