"""Worker failures, client disconnects, tracing and shared Redis state, against real sim processes (the
gateway's own retry and error logic against scripted fake engines: tests/gateway/test_dispatch_scripted.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.stack import (
    GatewayProcess,
    GatewayThread,
    Sim,
    free_port,
    gateway_config,
    model_dir,
    start_sims,
)

MODEL = model_dir().name
MSG = [{"role": "user", "content": "hello"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


def test_worker_killed_mid_stream_errors_that_stream_and_later_requests_succeed(tmp_path):
    sims = start_sims([Sim("prefix", ms_per_token=20.0), Sim("prefix", ms_per_token=20.0)], tmp_path)
    gw = GatewayThread(gateway_config(sims)).start()
    try:
        c = _client(gw.url)
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=200, stream=True)
        victim = next(s for s in sims if s.address == raw.headers["x-duet-worker"])
        stream = raw.parse()
        got = []
        with pytest.raises(openai.APIError) as e:  # an error event, never a silent truncation
            for chunk in stream:
                got.append(chunk)
                if len(got) == 3:
                    victim.kill()
        assert "mid-stream" in str(e.value.message)
        for i in range(6):  # the dead worker is retried around, then left out by health checks
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
            assert r.choices[0].finish_reason == "length"
    finally:
        gw.stop()
        for s in sims:
            s.kill()


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_engine_request_and_frees_pages(tmp_path, stream):
    sim = start_sims([Sim("prefix", ms_per_token=20.0)], tmp_path)[0]
    gw = GatewayThread(gateway_config([sim])).start()
    try:
        body = {"model": MODEL, "messages": MSG, "max_tokens": 500, "stream": stream}
        if stream:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
                load = sim.load()
                assert load.num_running == 1 and load.kv_pages_used > 0
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=0.5)
        assert _wait(lambda: sim.load().num_running == 0), "the engine still runs the request"
        assert sim.load().kv_pages_used == 0
        assert _wait(lambda: gw.gateway.pending.count == 0)
    finally:
        gw.stop()
        sim.kill()


def test_span_tree_http_route_grpc_client_engine(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from duet.sim_worker import SimSpec, serve

    port, stop, ready = free_port(), None, threading.Event()
    loop = asyncio.new_event_loop()

    def run_sim():
        nonlocal stop
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        started = asyncio.Event()

        async def main():
            task = asyncio.ensure_future(serve(SimSpec(model_id=MODEL, worker_id="traced-sim", ms_per_token=1.0), "127.0.0.1", port,
                                               ready=started, stop=stop, tracer_provider=provider))
            await started.wait()
            ready.set()
            await task

        loop.run_until_complete(main())

    t = threading.Thread(target=run_sim, daemon=True)
    t.start()
    assert ready.wait(10)
    sim = Sim(port=port)
    gw = GatewayThread(gateway_config([sim]), tracer_provider=provider).start()
    try:
        _client(gw.url).chat.completions.create(model=MODEL, messages=MSG, max_tokens=3,
                                                extra_headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
        assert _wait(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()))
        spans = {s.name: s for s in exporter.get_finished_spans()}
        http = spans["POST /v1/chat/completions"]
        route = spans["route"]
        client = spans["duet.engine.v1.Engine/Generate"]
        engine = spans["engine.generate"]
        assert http.context.trace_id == int("ab" * 16, 16)  # continues the caller's trace
        assert route.parent.span_id == http.context.span_id
        assert client.parent.span_id == route.context.span_id
        assert engine.parent.span_id == client.context.span_id  # W3C context crossed gRPC metadata
        assert {s.context.trace_id for s in (http, route, client, engine)} == {http.context.trace_id}
        assert route.attributes["duet.worker"] == "traced-sim"
    finally:
        gw.stop()
        loop.call_soon_threadsafe(stop.set)
        t.join(10)


def test_two_gateway_processes_sharing_redis_agree_on_affinity(tmp_path, clean_redis_url):
    redis_url = clean_redis_url
    sims = start_sims([Sim("prefix"), Sim("prefix"), Sim("prefix")], tmp_path)
    a = GatewayProcess(gateway_config(sims, redis=redis_url), tmp_path, "a")
    b = GatewayProcess(gateway_config(sims, redis=redis_url), tmp_path, "b")
    try:
        a.wait_ready()
        b.wait_ready()
        ca, cb = _client(a.url), _client(b.url)
        for i in range(4):
            session = {"x-session-id": f"session-{i}-{time.time()}"}
            first = ca.completions.with_raw_response.create(model=MODEL, prompt=f"conversation {i} " * 20,
                                                            max_tokens=1, extra_headers=session)
            second = cb.completions.with_raw_response.create(model=MODEL, prompt=f"other text {i}", max_tokens=1,
                                                             extra_headers=session)
            assert second.headers["x-duet-worker"] == first.headers["x-duet-worker"]
            assert second.headers["x-duet-route-reason"] == "affinity"
    finally:
        a.stop()
        b.stop()
        for s in sims:
            s.kill()


def test_workers_registered_in_redis_are_discovered_and_dropped_when_gone(tmp_path, clean_redis_url):
    redis_url = clean_redis_url
    gw = GatewayThread(gateway_config([], redis=redis_url)).start(wait_workers=0)
    sim = start_sims([Sim("prefix", redis=redis_url)], tmp_path)[0]
    try:
        assert _wait(lambda: any(v.healthy for v in gw.gateway.router.views()), 10), "registered worker not picked up"
        raw = _client(gw.url).completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
        assert raw.headers["x-duet-worker"] == sim.address
        sim.kill()  # no more heartbeats: the entry expires and the worker leaves the pool
        assert _wait(lambda: not gw.gateway.router.views(), 15), "expired worker still in the pool"
    finally:
        gw.stop()
        sim.kill()


def _worker_series(metrics_page: str, worker: str) -> dict[str, float]:
    """The page's samples labelled with this worker: `name{labels}` -> value."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics_page.splitlines()
            if not line.startswith("#") and f'worker="{worker}"' in line}


def test_a_worker_that_leaves_takes_its_series_off_metrics_and_one_that_fails_stays_at_0(tmp_path, clean_redis_url):
    # under autoscaling or rolling restarts workers come and go under new ids: a departed one's series must go,
    # or /metrics grows without bound and dashboards show ghosts; a configured worker that fails stays, as 0
    static = start_sims([Sim("prefix", worker_id="static")], tmp_path)[0]
    gw = GatewayThread(gateway_config([static], redis=clean_redis_url)).start()
    churner = start_sims([Sim("paged", worker_id="churner", redis=clean_redis_url)], tmp_path)[0]

    def page() -> str:
        return httpx.get(gw.url + "/metrics").text

    def polled(worker: str, engine: str) -> set[str]:  # the series the fleet's polls set for a worker
        return {f'duet_worker_healthy{{engine="{engine}",worker="{worker}"}}',
                f'duet_worker_num_requests_running{{worker="{worker}"}}',
                f'duet_worker_kv_cache_usage_perc{{worker="{worker}"}}'}

    try:
        assert _wait(lambda: set(_worker_series(page(), "churner")) >= polled("churner", "paged"), 10), page()
        text = page()
        assert _worker_series(text, "churner")['duet_worker_healthy{engine="paged",worker="churner"}'] == 1.0
        assert churner.address not in text  # the polls named it by its id, not its address
        static_series = _worker_series(text, "static")
        assert set(static_series) >= polled("static", "prefix")

        churner.kill()  # no more heartbeats: its registration lapses and it leaves the fleet
        assert _wait(lambda: gw.gateway.fleet.get("churner") is None, 20), "the killed worker never left the fleet"
        text = page()
        assert _worker_series(text, "churner") == {}
        assert churner.address not in text
        assert set(_worker_series(text, "static")) == set(static_series)
        assert _worker_series(text, "static")['duet_worker_healthy{engine="prefix",worker="static"}'] == 1.0

        static.kill()  # configured, so it stays in the fleet: failing, it shows as 0
        healthy = 'duet_worker_healthy{engine="prefix",worker="static"}'
        assert _wait(lambda: _worker_series(page(), "static").get(healthy) == 0.0, 10), page()
        assert set(_worker_series(page(), "static")) == set(static_series)
    finally:
        gw.stop()
        static.kill()
        churner.kill()


def test_kv_events_feed_the_index_and_a_repeated_prompt_goes_where_it_is_cached(tmp_path):
    sims = start_sims([Sim("prefix"), Sim("prefix")], tmp_path)
    gw = GatewayThread(gateway_config(sims)).start()
    try:
        c = _client(gw.url)
        prompt = "a long shared document " * 60
        first = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert first.headers["x-duet-route-reason"] == "least_load"
        worker = first.headers["x-duet-worker"]
        # the worker's STORED events reach the gateway over WatchKvEvents
        assert _wait(lambda: 'duet_kv_events_total{kind="stored"}' in httpx.get(gw.url + "/metrics").text)
        for _ in range(3):
            again = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert again.headers["x-duet-worker"] == worker
            assert again.headers["x-duet-route-reason"] == "cache_match"
            assert again.parse().usage.prompt_tokens_details.cached_tokens >= 16
    finally:
        gw.stop()
        for s in sims:
            s.kill()
