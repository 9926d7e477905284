"""Request priority end to end: the OpenAI SDK's `extra_body={"priority": p}` -> gateway -> GenerateRequest ->
a real engine_paged / engine_prefix worker (tiny model, real gRPC). One running slot (max_num_seqs=1) is held by
a long ignore_eos stream; low-priority requests queue behind it, then a high-priority one; the blocker is then
cancelled, and the queue drains one request at a time, so the order they finish in is the order of admission.
With a priority schedule policy the high-priority request overtakes the queue; with paged `fcfs` it waits its
turn (priority is ignored there)."""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from duet.engine_config import EngineConfig, PagedConfig, PrefixConfig
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from engine_core.worker import Worker
from engine_paged.worker import build_engine as build_paged
from engine_prefix.worker import build_engine as build_prefix
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir

LOW, HIGH = 10, -10
QUEUED = 3  # low-priority requests queued before the high-priority one
# each queued request decodes this many tokens alone: responses come back that many steps apart, far more
# than the HTTP path's jitter, so the order the client sees them finish is the order they were admitted
QUEUED_TOKENS = 48


def build(kind: str, policy: str):
    engine = EngineConfig(model=str(model_dir()), device="cpu", kv_cache_tokens=8192, max_num_seqs=1,
                          worker_id=f"{kind}-{policy}")
    if kind == "paged":
        return lambda: build_paged(PagedConfig(engine, schedule_policy=policy))
    return lambda: build_prefix(PrefixConfig(engine, schedule_policy=policy))


async def wait_load(stub, check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = await stub.GetLoad(pb.GetLoadRequest())
        if check(load):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the worker never had {what} (last load: {load})")


async def finish_order(kind: str, policy: str) -> list[str]:
    worker = Worker(build(kind, policy), port=0, drain_timeout=5)
    port = await worker.start()
    gw = GatewayThread(gateway_config([Sim(port=port)]))
    await asyncio.to_thread(gw.start)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.EngineStub(channel)
    model = model_dir().name
    done: list[str] = []

    async def complete(name: str, priority: int) -> None:
        await client.completions.create(model=model, prompt=f"request {name}", max_tokens=QUEUED_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "priority": priority})
        done.append(name)

    try:
        blocker = await client.completions.create(model=model, prompt="hold the only slot", max_tokens=1500,
                                                  stream=True, extra_body={"ignore_eos": True, "priority": LOW})
        await blocker.__anext__()  # it runs: the one slot is taken
        tasks = []
        for i in range(QUEUED):  # one at a time, so their arrival order is known
            tasks.append(asyncio.create_task(complete(f"low{i}", LOW)))
            await wait_load(stub, lambda load, n=i + 1: load.num_waiting == n, f"{i + 1} waiting")
        tasks.append(asyncio.create_task(complete("high", HIGH)))
        await wait_load(stub, lambda load: load.num_waiting == QUEUED + 1, f"{QUEUED + 1} waiting")
        await blocker.close()  # the gateway cancels its stream; the engine frees the slot
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        return done
    finally:
        await channel.close()
        await client.close()
        await asyncio.to_thread(gw.stop)
        await worker.shutdown()


@pytest.mark.parametrize("kind, policy", [("paged", "priority"), ("prefix", "fcfs")])
async def test_a_high_priority_request_overtakes_the_queued_ones(kind, policy):
    assert await finish_order(kind, policy) == ["high"] + [f"low{i}" for i in range(QUEUED)]


async def test_the_paged_fcfs_policy_ignores_priority():
    assert await finish_order("paged", "fcfs") == [f"low{i}" for i in range(QUEUED)] + ["high"]
