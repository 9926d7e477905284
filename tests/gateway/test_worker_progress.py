"""What the worker pool takes for progress (issue 21): the step counter advancing, a step still
running (a long prefill step on a slow device) for no longer than `max_step_s`, or no work at all.
The pool polls a scripted EngineClient, so each poll's GetLoad is what the test says."""

from __future__ import annotations

import math

from duet.rpc import engine_pb2 as pb
from gateway.backends.engine_client import EngineCallError
from gateway.backends.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.routing.prefix_index import WorkerBlockIndex


class ScriptedClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.loads: list[pb.EngineLoad] = []

    async def check_health(self, timeout=None) -> bool:
        return True

    async def get_info(self, timeout=None) -> pb.EngineInfo:
        return pb.EngineInfo(worker_id="w", engine_kind="paged", model_id="m")

    async def get_load(self, timeout=None) -> pb.EngineLoad:
        return self.loads.pop(0)

    async def watch_kv_events(self):
        raise EngineCallError("w", "UNIMPLEMENTED", "no events", False)
        yield  # an async generator

    async def close(self) -> None:
        pass


async def test_a_worker_with_work_shows_progress_only_while_it_steps():
    clients: dict[str, ScriptedClient] = {}

    def factory(address: str) -> ScriptedClient:
        return clients.setdefault(address, ScriptedClient(address))

    pool = Fleet(("a:1",), WorkerBlockIndex(), GatewayMetrics(), client_factory=factory, max_step_s=60.0)
    client = factory("a:1")
    busy = {"num_running": 1, "num_waiting": 3}
    client.loads = [pb.EngineLoad(num_steps=10, **busy)]
    await pool.start()
    try:
        seen = [pool.progress_at("w")]
        script = [
            (pb.EngineLoad(num_steps=11, **busy), True),  # a step finished
            (pb.EngineLoad(num_steps=11, step_running_s=25.0, **busy), True),  # a long prefill step, still running
            (pb.EngineLoad(num_steps=11, step_running_s=61.0, **busy), False),  # longer than any healthy step
            (pb.EngineLoad(num_steps=11, **busy), False),  # work, no step: stuck
            (pb.EngineLoad(num_steps=11), True),  # no work at all: nothing to make progress on
        ]
        for load, progressed in script:
            client.loads.append(load)
            await pool.poll_once()
            now = pool.progress_at("w")
            assert (now > seen[-1]) == progressed, load
            seen.append(now)
        assert seen[0] > -math.inf  # first contact counts
        assert pool.progress_at("unknown") == -math.inf
    finally:
        await pool.close()
