"""Acting on the pool planner: `duet up --workers N` switches workers' engine kinds toward the
gateway's target split (`GET /admin/pools` -> `target`, gateway/control/pool_planner.py).

One switch at a time, and none is lost:

1. pick the worker of the kind that has too many with the least in flight;
2. drain it at the gateway (`POST /admin/workers/{id}/drain`: no new requests are routed to it);
3. wait until the gateway sees nothing running or queued on it (requests in flight finish there);
4. `switch(slot, kind)`: the caller stops that worker and starts it again as the other kind, on the
   same address, and returns its new worker id (this module starts no process itself: `duet up`, or a
   supervisor, owns the processes);
5. wait until the gateway has the new worker healthy, with the new kind (it re-reads the worker's
   info when it comes back: gateway/backends/fleet.py), before the next switch.

Only the gateway's HTTP admin API is used, so the same loop works against any gateway.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("duet.pool_manager")

KINDS = ("paged", "prefix")
SwitchWorker = Callable[[int, str], str]  # (slot, new kind) -> new worker id; stops, then starts


class AdminApiError(RuntimeError):
    """The gateway's admin API did not answer as expected."""


class Stopped(Exception):
    """`should_stop()` turned true while a switch was waiting."""


@dataclass
class AdminApi:
    url: str
    admin_key: str
    timeout_s: float = 5.0

    def _call(self, method: str, path: str) -> dict:
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"Bearer {self.admin_key}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read() or b"{}")
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            raise AdminApiError(f"{method} {path}: {e}") from None

    def target(self) -> dict[str, int]:
        return self._call("GET", "/admin/pools")["target"]

    def workers(self) -> dict[str, dict]:
        return {w["worker_id"]: w for w in self._call("GET", "/admin/workers")["workers"]}

    def drain(self, worker_id: str) -> None:
        self._call("POST", f"/admin/workers/{worker_id}/drain")


@dataclass
class PoolManager:
    api: AdminApi
    kinds: list[str]  # the engine kind of each slot
    worker_ids: list[str]  # the worker id of each slot, as the gateway knows it
    switch: SwitchWorker
    poll_s: float = 0.5
    drain_timeout_s: float = 120.0  # in-flight requests get this long; then the engine's own drain
    start_timeout_s: float = 120.0
    should_stop: Callable[[], bool] = lambda: False  # checked while waiting (Ctrl-C, a dead child)
    switches: list[tuple[float, str, str, str]] = field(default_factory=list)  # (time, old id, new id, kind)

    def counts(self) -> dict[str, int]:
        return {k: self.kinds.count(k) for k in KINDS}

    def step(self) -> bool:
        """One switch toward the gateway's target, if the split differs. True if a worker switched."""
        target = self.api.target()
        if sum(target.get(k, 0) for k in KINDS) != len(self.kinds):
            return False  # the planner counts a different fleet (a worker restarting): wait
        counts = self.counts()
        surplus = next((k for k in KINDS if counts[k] > target.get(k, 0)), None)
        if surplus is None:
            return False
        wanted = next(k for k in KINDS if k != surplus)
        rows = self.api.workers()
        slots = [i for i, k in enumerate(self.kinds) if k == surplus]
        slot = min(slots, key=lambda i: _in_flight(rows.get(self.worker_ids[i])))
        old = self.worker_ids[slot]
        log.info("pool manager: switching %s from %s to %s (target %s, now %s)", old, surplus, wanted, target, counts)
        self.api.drain(old)
        self._wait_idle(old)
        new = self.switch(slot, wanted)
        self.kinds[slot], self.worker_ids[slot] = wanted, new
        self._wait_serving(new, wanted)
        self.switches.append((time.time(), old, new, wanted))
        return True

    def _wait_idle(self, worker_id: str) -> None:
        # two quiet polls in a row: a request routed just before the drain shows up in the first
        deadline, quiet = time.monotonic() + self.drain_timeout_s, 0
        while time.monotonic() < deadline and quiet < 2:
            self._sleep()
            quiet = quiet + 1 if _in_flight(self.api.workers().get(worker_id)) == 0 else 0
        if quiet < 2:
            log.warning("pool manager: %s still busy after %.0fs; its engine drains the rest on stop",
                        worker_id, self.drain_timeout_s)

    def _wait_serving(self, worker_id: str, kind: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            row = self.api.workers().get(worker_id)
            if row and row.get("healthy") and row.get("engine_kind") == kind and not row.get("draining"):
                return
            self._sleep()
        raise AdminApiError(f"worker {worker_id} did not come back as {kind} within {self.start_timeout_s:.0f}s")

    def _sleep(self) -> None:
        if self.should_stop():
            raise Stopped()
        time.sleep(self.poll_s)

    def run(self) -> None:
        """Reconcile until `should_stop()`; errors of one round are logged and retried."""
        try:
            while not self.should_stop():
                try:
                    if not self.step():
                        self._sleep()
                except AdminApiError as e:
                    log.warning("pool manager: %s", e)
                    self._sleep()
        except Stopped:
            return


def _in_flight(row: dict | None) -> int:
    return 0 if row is None else int(row.get("num_running", 0)) + int(row.get("num_waiting", 0))


def pool_manager_for(url: str, admin_key: str, slots: list[tuple[str, str, int]], stack, start_worker,
                     should_stop: Callable[[], bool]) -> PoolManager:
    """The manager `duet up --workers` runs over its workers, slots[i] = (worker id, kind, port): a
    switch stops that child and starts `w{i}-{kind}-g{n}` on the same port (a new id each time: the
    gateway keeps a drained id drained). `stack` is anything with `stop(name)` (duet.up.Stack, or the
    supervisor of duet/supervisor.py); `start_worker(name, kind, port)` starts the child. `should_stop`
    is called every poll while a switch waits: a caller with its own loop (a supervisor's `poll()`)
    can do that work there."""
    names = [name for name, _, _ in slots]
    generation = [0] * len(slots)

    def switch(slot: int, kind: str) -> str:
        stack.stop(names[slot])
        generation[slot] += 1
        names[slot] = f"w{slot}-{kind}-g{generation[slot]}"
        start_worker(names[slot], kind, slots[slot][2])
        return names[slot]

    return PoolManager(AdminApi(url, admin_key), [k for _, k, _ in slots], list(names), switch,
                       should_stop=should_stop)
