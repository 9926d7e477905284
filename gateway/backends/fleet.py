"""The fleet: every engine worker the gateway knows (Duet's own and external backends), whether it is
healthy, how loaded it is, and which ones an operator drained. (A *pool* is the workers of one engine
kind: gateway/control/pool_planner.py sizes them.)

Workers come from the config (static) and from the state store's registry (workers that register
themselves in Redis with a TTL). One poll loop every `poll_interval_s` refreshes the registry, runs
a grpc.health.v1 check and `GetLoad` on every worker (and `GetInfo` once per connection); per worker
a task follows `WatchKvEvents` into the routing helper's `WorkerBlockIndex`. `views()` is the
snapshot the routing policy reads; it does no I/O.

Progress: `WorkerHandle.progress_at` is when a poll last saw the worker's step counter (`num_steps`)
advance, a step running for no longer than `max_step_s` (one long prefill step on a slow device;
the first-token deadline, since a whole prefill must fit in it), or the worker with no work at all.
The stream watchdog (gateway/serving/timeouts.py) takes a worker whose progress stopped while it has work for
stalled; one that is merely busy keeps stepping.

Logs: a poll is silent; a change of what the polls find is one line (a worker serving, not serving yet,
stopped answering, serving again, gone from the registry), so the log reads as the pool's history.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from duet.rpc import engine_pb2 as pb
from gateway.backends.engine_client import EngineCallError, EngineClient, GrpcEngineClient
from gateway.metrics import GatewayMetrics
from gateway.routing.prefix_index import WorkerBlockIndex
from gateway.routing.route_types import WorkerView
from gateway.ticks import sleep_to_tick

log = logging.getLogger("duet.gateway.workers")

_KV_KINDS = {pb.KvEvent.STORED: "stored", pb.KvEvent.EVICTED: "evicted", pb.KvEvent.CLEARED: "cleared"}


@dataclass
class WorkerHandle:
    """The gateway's side of one engine worker: its client and what the polls last saw. (The worker
    itself, the process serving an engine, is engine_core.worker.Worker.)"""

    address: str
    client: EngineClient
    static: bool
    info: pb.EngineInfo | None = None
    load: pb.EngineLoad | None = None
    healthy: bool = False
    watch_task: asyncio.Task | None = None
    progress_at: float = -math.inf  # time.monotonic() of the last poll that saw progress (module doc)
    # what the polls found: "" (not polled yet), "waiting" (never served yet), "serving", "lost"; a change is logged
    poll_state: str = ""

    @property
    def worker_id(self) -> str:
        return (self.info.worker_id if self.info is not None else "") or self.address

    @property
    def name(self) -> str:
        """How the log names it: its id and address (an HTTP backend's id is its address)."""
        return self.address if self.worker_id == self.address else f"{self.worker_id} at {self.address}"

    def view(self) -> WorkerView | None:
        if self.info is None:
            return None
        load = self.load or pb.EngineLoad()
        return WorkerView(
            worker_id=self.worker_id, model_id=self.info.model_id, engine_kind=self.info.engine_kind,
            version=self.info.version, capabilities=frozenset(self.info.capabilities),
            healthy=self.healthy, draining=load.draining, num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_usage=load.kv_pages_used / load.kv_pages_total if load.kv_pages_total else 0.0,
            prefill_tokens_per_s=load.prefill_tokens_per_s, decode_tokens_per_s=load.decode_tokens_per_s,
        )


class Fleet:
    """The known workers by address and by id, polled in the background; `drained` holds the ids an operator
    drained through the admin API (routing leaves them out; their running requests finish)."""

    def __init__(
        self,
        static_addresses: tuple[str, ...],
        index: WorkerBlockIndex,
        metrics: GatewayMetrics,
        state=None,
        poll_interval_s: float = 1.0,
        client_factory: Callable[[str], EngineClient] = GrpcEngineClient,
        max_step_s: float | None = None,
    ) -> None:
        self._max_step_s = max_step_s
        self._index = index
        self._metrics = metrics
        self._state = state
        self._poll_interval_s = poll_interval_s
        self._client_factory = client_factory
        self._workers: dict[str, WorkerHandle] = {}  # by address
        self._by_id: dict[str, WorkerHandle] = {}
        self._static = static_addresses
        self._task: asyncio.Task | None = None
        self.polled = asyncio.Event()  # set after the first full poll
        self.drained: set[str] = set()
        # called with a worker id that left the fleet (gone from the registry, or its address now serves
        # another worker): what was learned per worker elsewhere (routing's latency correction) goes with it
        self.on_gone: list[Callable[[str], None]] = []

    async def start(self) -> None:
        for addr in self._static:
            self._add(addr, static=True)
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in list(self._workers.values()):
            await self._remove(w)

    def _add(self, address: str, static: bool) -> WorkerHandle:
        w = self._workers.get(address)
        if w is None:
            w = self._workers[address] = WorkerHandle(address, self._client_factory(address), static)
        return w

    async def _remove(self, w: WorkerHandle) -> None:
        if self._workers.get(w.address) is w and not w.static:
            log.info("worker %s left the registry", w.name)
        self._workers.pop(w.address, None)
        self._by_id.pop(w.worker_id, None)
        if w.watch_task is not None:
            w.watch_task.cancel()
        self._index.remove_worker(w.worker_id)
        self._gone(w)
        await w.client.close()

    def _gone(self, w: WorkerHandle) -> None:
        """`w` (its id and engine kind as they were) left the fleet: its metric series and what the
        `on_gone` callbacks learned of it go."""
        self._metrics.forget_worker(w.worker_id, w.info.engine_kind if w.info else "")
        for callback in self.on_gone:
            callback(w.worker_id)

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self._by_id.get(worker_id)

    def views(self) -> list[WorkerView]:
        return [v for w in self._workers.values() if (v := w.view()) is not None]

    def workers(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def progress_at(self, worker_id: str) -> float:
        w = self._by_id.get(worker_id)
        return w.progress_at if w is not None else -math.inf

    def drain(self, worker_id: str) -> bool:
        """Stop routing to the worker (running requests finish); False: no such worker."""
        if worker_id not in self._by_id:
            return False
        self.drained.add(worker_id)
        return True

    def mark_failed(self, worker_id: str) -> None:
        """A call to this worker failed: leave it out until the next successful health check."""
        w = self._by_id.get(worker_id)
        if w is not None:
            w.healthy = False

    async def _poll_loop(self) -> None:
        while True:
            await sleep_to_tick(self._poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # the loop must outlive any one bad poll
                log.exception("worker poll failed")

    async def poll_once(self) -> None:
        if self._state is not None:
            await self._sync_registry()
        await asyncio.gather(*(self._check(w) for w in list(self._workers.values())))
        self.polled.set()

    async def _sync_registry(self) -> None:
        try:
            registered = await self._state.list_workers()
        except Exception as e:  # noqa: BLE001 - the state store keeps serving on what it knew; so do we
            log.debug("worker registry unavailable: %s", e)
            return
        live = set()
        for entry in registered:
            addr = entry.get("address") if isinstance(entry, dict) else None
            if addr:
                live.add(addr)
                self._add(addr, static=False)
        for w in list(self._workers.values()):
            if not w.static and w.address not in live:
                await self._remove(w)

    async def _check(self, w: WorkerHandle) -> None:
        ok = await w.client.check_health()
        try:
            if ok and (w.info is None or not w.healthy):
                # first contact, or back after a failure: it may have restarted as another worker
                # (`duet up --workers` switches a worker's engine kind on the same address)
                info = await w.client.get_info()
                if w.info is None or (info.worker_id, info.engine_kind) != (w.info.worker_id, w.info.engine_kind):
                    if w.info is not None:
                        self._by_id.pop(w.worker_id, None)
                        self._index.remove_worker(w.worker_id)
                        self._gone(w)
                    else:  # the polls before its first answer named it by address, with no engine kind
                        self._metrics.forget_worker(w.address, "")
                    if w.watch_task is not None:
                        w.watch_task.cancel()
                    w.info = info
                    self._by_id[w.worker_id] = w
                    w.watch_task = asyncio.create_task(self._watch_kv(w))
            if ok:
                before, w.load = w.load, await w.client.get_load()
                if before is None or self._progressed(before, w.load):
                    w.progress_at = time.monotonic()
        except EngineCallError:
            ok = False
        w.healthy = ok
        self._log_change(w, ok)
        if self._workers.get(w.address) is not w:
            return  # it left the fleet while this poll waited on it: its series are gone and stay gone
        engine = w.info.engine_kind if w.info else ""
        self._metrics.worker_healthy.labels(w.worker_id, engine).set(1 if ok else 0)
        if w.load is not None:
            self._metrics.worker_running.labels(w.worker_id).set(w.load.num_running)
            total = w.load.kv_pages_total
            self._metrics.worker_kv_usage.labels(w.worker_id).set(w.load.kv_pages_used / total if total else 0)

    @staticmethod
    def _log_change(w: WorkerHandle, ok: bool) -> None:
        """One line when what the polls find changes (a failed call's mark_failed is not a poll's finding)."""
        before = w.poll_state
        if ok and before != "serving":
            w.poll_state = "serving"
            i = w.info
            log.info("worker %s: %s %s (%s, %s)", w.name, "serving again" if before == "lost" else "serving",
                     i.model_id, i.engine_kind, i.version)
        elif not ok and before == "":
            w.poll_state = "waiting"
            log.info("worker at %s: not serving yet (starting or loading); polled until it is", w.address)
        elif not ok and before == "serving":
            w.poll_state = "lost"
            log.warning("worker %s stopped answering the gateway's polls: routed around until it is back", w.name)

    def _progressed(self, before: pb.EngineLoad, now: pb.EngineLoad) -> bool:
        if now.num_steps != before.num_steps or not (now.num_running or now.num_waiting):
            return True
        return 0 < now.step_running_s and (self._max_step_s is None or now.step_running_s <= self._max_step_s)

    async def _watch_kv(self, w: WorkerHandle) -> None:
        """Follow the worker's KV events; reconnect while the worker stays in the fleet."""
        wid = w.worker_id
        reconnect = False
        while self._workers.get(w.address) is w:
            if reconnect:
                # events were missed (or the worker restarted with an empty cache): start the
                # worker's table over rather than trust it
                self._index.remove_worker(wid)
            reconnect = True
            try:
                async for batch in w.client.watch_kv_events():
                    for ev in batch.events:
                        kind = _KV_KINDS.get(ev.kind)
                        if kind is not None:
                            self._index.apply_kv_event(wid, kind, list(ev.block_hashes))
                            self._metrics.kv_events.labels(kind).inc()
            except EngineCallError as e:
                if e.code == "UNIMPLEMENTED":
                    return  # an engine without KV events: decisions alone feed the index
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV event stream of %s failed", wid)
            await asyncio.sleep(max(self._poll_interval_s, 0.5))
