"""A real `duet engine paged --tensor-parallel-size 2` process: a rank that dies or hangs takes the worker
down within a bounded time, with no rank process left running; SIGTERM still drains and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.model_make import make_checkpoint
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc
from tests.support import proc_tree

COLLECTIVE_TIMEOUT_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tp_tiny"), preset="tiny")


async def _wait_serving(port: int, proc, timeout: float = 180.0) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                resp = await health.Check(health_pb2.HealthCheckRequest(service="duet.engine.v1.Engine"), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("the tensor-parallel worker never became SERVING")


def _rank_pids(worker_pid: int) -> list[int]:
    # the rank processes are the worker's children running multiprocessing's spawn entry
    return [p for p in proc_tree.descendants(worker_pid)
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(proc_tree.alive, pids)):
        time.sleep(0.2)
    return [p for p in pids if proc_tree.alive(p)]


@pytest.fixture
def tp_worker(tiny_checkpoint):
    port = free_port()
    env = {**os.environ, "DUET_TP_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "engine", "paged", "--model", str(tiny_checkpoint),
                             "--port", str(port), "--device", "cpu", "--kv-cache-tokens", "2048",
                             "--tensor-parallel-size", "2"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc, port
    finally:
        for pid in proc_tree.descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def _serving_ranks(proc, port) -> list[int]:
    await _wait_serving(port, proc)
    ranks = _rank_pids(proc.pid)
    assert len(ranks) == 1, ranks
    return ranks


async def test_killing_a_rank_takes_the_worker_down_and_leaves_nothing_running(tp_worker):
    proc, port = tp_worker
    ranks = await _serving_ranks(proc, port)
    everything = proc_tree.descendants(proc.pid)
    os.kill(ranks[0], signal.SIGKILL)
    start = time.monotonic()
    code = await asyncio.to_thread(proc.wait, 30)
    assert code != 0 and time.monotonic() - start < 30
    assert b"exited with code -9" in proc.stderr.read()
    assert _wait_gone(everything, 15) == []


async def test_a_hung_rank_takes_the_worker_down_at_the_collective_timeout(tp_worker):
    proc, port = tp_worker
    ranks = await _serving_ranks(proc, port)
    everything = proc_tree.descendants(proc.pid)
    os.kill(ranks[0], signal.SIGSTOP)  # alive but never answers: only the collective timeout can tell
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate(pb.GenerateRequest(
            request_id="r", prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=4, temperature=0.0)))
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the server went away mid-stream
    code = await asyncio.to_thread(proc.wait, 60)
    assert code != 0 and time.monotonic() - start < COLLECTIVE_TIMEOUT_S + 45
    assert _wait_gone(everything, 15) == []


async def test_sigterm_stops_every_rank_and_exits_zero(tp_worker):
    proc, port = tp_worker
    await _serving_ranks(proc, port)
    everything = proc_tree.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 60) == 0
    assert _wait_gone(everything, 15) == []
