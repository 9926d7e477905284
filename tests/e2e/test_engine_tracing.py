"""One trace from the gateway into a real engine: a gateway (uvicorn thread) calls a real engine_paged worker
(in-process grpc.aio server on the tiny model) and the engine's "engine.generate" span is the child of the
gateway's gRPC client span, in the caller's trace."""

from __future__ import annotations

import asyncio

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from duet.engine_config import EngineConfig, PagedConfig
from engine_core.worker import Worker
from engine_paged.worker import build_engine
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir

TRACE_ID = "ab" * 16


async def test_engine_span_is_the_child_of_the_gateways_grpc_client_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = model_dir()
    config = PagedConfig(EngineConfig(model=str(model), kv_cache_tokens=2048, page_size=16,
                                      max_num_batched_tokens=256, worker_id="traced-paged"))
    worker = Worker(lambda: build_engine(config),
                    port=0, drain_timeout=5, tracer_provider=provider)
    port = await worker.start()
    # the gateway runs its own event loop in a thread; this loop keeps serving the engine meanwhile
    gw = GatewayThread(gateway_config([Sim(port=port)]), tracer_provider=provider)
    await asyncio.to_thread(gw.start)
    try:
        body = {"model": model.name, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(gw.url + "/v1/chat/completions", json=body,
                             headers={"traceparent": f"00-{TRACE_ID}-{'cd' * 8}-01"})
        assert r.status_code == 200, r.text
        for _ in range(100):  # the HTTP server span ends just after the last byte
            if any(s.name.startswith("POST") for s in exporter.get_finished_spans()):
                break
            await asyncio.sleep(0.05)
        spans = {s.name: s for s in exporter.get_finished_spans()}
        client = spans["duet.engine.v1.Engine/Generate"]
        engine = spans["engine.generate"]
        assert engine.parent.span_id == client.context.span_id  # W3C context crossed the gRPC metadata
        assert engine.context.trace_id == client.context.trace_id == int(TRACE_ID, 16)
        assert engine.attributes["duet.engine"] == "paged"
        assert engine.attributes["duet.request_id"] == r.headers["x-request-id"]
        assert engine.attributes["duet.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
        assert engine.attributes["duet.cached_tokens"] == 0
    finally:
        await asyncio.to_thread(gw.stop)
        await worker.shutdown()
