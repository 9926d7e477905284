"""A real `duet engine paged` process: health, Prometheus metrics, and SIGTERM drain (exit 0)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.launcher import free_port
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc


async def wait_serving(channel, proc, timeout=120.0):
    health = health_pb2_grpc.HealthStub(channel)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            resp = await health.Check(health_pb2.HealthCheckRequest(service="duet.engine.v1.Engine"), timeout=1)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("worker never became SERVING")


async def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_checkpoint):
    port, metrics_port = free_port(), free_port()
    # a plain child process: the test only signals it and waits for its exit code
    proc = subprocess.Popen([sys.executable,  # noqa: ASYNC220
                             "-m", "duet.cli", "engine", "paged", "--model", str(tiny_checkpoint),
                             "--port", str(port), "--device", "cpu", "--kv-cache-tokens", "4096",
                             "--drain-timeout", "60", "--metrics-port", str(metrics_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel, proc)
            stub = engine_pb2_grpc.EngineStub(channel)
            call = stub.Generate(pb.GenerateRequest(request_id="inflight", prompt_token_ids=[1, 2, 3],
                                                    sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True,
                                                                               temperature=0.0)))
            first = await call.read()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service="duet.engine.v1.Engine"))
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            late = stub.Generate(pb.GenerateRequest(request_id="late", prompt_token_ids=[1],
                                                    sampling=pb.SamplingParams(max_tokens=2)))
            try:
                await late.read()
                raise AssertionError("a request was accepted while draining")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
            tokens = list(first.token_ids)
            last = first
            while (msg := await call.read()) is not grpc.aio.EOF:
                tokens += msg.token_ids
                last = msg
            assert len(tokens) == 400 and last.finish_reason == pb.FINISH_REASON_LENGTH
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_metrics_endpoint_reports_latency_and_load(tiny_checkpoint):
    port, metrics_port = free_port(), free_port()
    # a plain child process: the test only signals it and waits for its exit code
    proc = subprocess.Popen([sys.executable,  # noqa: ASYNC220
                             "-m", "duet.cli", "engine", "paged", "--model", str(tiny_checkpoint),
                             "--port", str(port), "--device", "cpu", "--kv-cache-tokens", "4096",
                             "--metrics-port", str(metrics_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel, proc)
            stub = engine_pb2_grpc.EngineStub(channel)
            async for _ in stub.Generate(pb.GenerateRequest(request_id="m", prompt_token_ids=[4, 5],
                                                            sampling=pb.SamplingParams(max_tokens=5))):
                pass
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
        for name in ("duet_time_to_first_token_seconds_count", "duet_inter_token_latency_seconds_count",
                     "duet_e2e_request_latency_seconds_count", "duet_num_requests_running",
                     "duet_kv_cache_usage_perc", "duet_num_preemptions_total", "duet_prefix_cache_queries_total"):
            assert name in body, name
        assert 'duet_e2e_request_latency_seconds_count{engine="paged"' in body
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
