"""Shadow traffic, the sending side: a copy of a share of a model's live requests goes to the candidate pool
of its shadow (gateway/control/shadow.py), and its answer is measured and thrown away.

`Mirror.tap(prep, decision)` is called by start (gateway/serving/start.py) once the primary's engine
stream has answered, so the copy can never delay the user's request: it only decides (the share, the
shadow's own concurrency cap, the gateway's load, a healthy candidate worker) and starts a task that nobody
on the user's path awaits. It returns a `Tap` the user's run (gateway/serving/runs.py) feeds with the
primary's token ids and outcome, so the books hold both answers to the same request and, for a greedy
request, whether the candidate said the same tokens.

The cost is bounded: at most `max_concurrency` copies in flight per model, none started while the gateway
holds `drop_above_pending` of its `max_pending_requests` or while its event loop runs `max_loop_lag_ms` late
(`run` measures the lag: a loop that is late is short of CPU, and a copy's messages would queue before the
users'), so copies are the first work dropped under load; a copy's call ends within the gateway's request
timeout, and copies never enter routing's tables, the circuit breakers, the pending count or the request
stats the canary rollback reads.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import replace

from gateway.backends.engine_client import EngineCallError
from gateway.backends.fleet import Fleet
from gateway.control.shadow import PRIMARY, SHADOW, ShadowConfig, ShadowLedger
from gateway.routing.route_types import RouteDecision
from gateway.serving.generation import Prepared, to_pb
from gateway.serving.pending import PendingRequests
from gateway.serving.request_class import request_class
from gateway.ticks import sleep_to_tick

log = logging.getLogger("duet.gateway.mirror")
LAG_PROBE_S = 0.05  # how often `run` measures the event loop's lag while a shadow runs
IDLE_CHECK_S = 1.0  # how often `run` looks for a shadow to start probing for: twenty wake-ups a second cost an idle
# gateway about 2 ms of CPU a second (docs/benchmarks.md, the gateway's CPU per request), for a figure only `tap` reads


def is_greedy(prep: Prepared) -> bool:
    """A request whose answer is determined by the model: one greedy choice, no beam search."""
    s = prep.api.sampling
    return s.temperature == 0 and s.n == 1 and s.beam_width == 1 and prep.max_tokens > 0


class Tap:
    """One mirrored request: the primary's side (fed by its run) and the shadow's (fed by the copy)."""

    def __init__(self, ledger: ShadowLedger, config: ShadowConfig, cls: str, greedy: bool) -> None:
        self.ledger, self.config, self.model, self.cls, self.greedy = ledger, config, config.model, cls, greedy
        self.primary_tokens: list[int] = []
        self._primary: bool | None = None  # ok, once finished
        self._shadow: tuple[bool, list[int]] | None = None

    def primary_token_ids(self, ids: list[int]) -> None:
        if self.greedy:
            self.primary_tokens.extend(ids)

    def _current(self) -> bool:
        """Whether the shadow this copy was made for still runs (a new candidate's books start empty)."""
        return self.ledger.configs.get(self.model) is self.config

    def primary_finished(self, status: str, ttft_s: float | None, tpot_s: float | None) -> None:
        if status == "499" or not self._current():  # the client left: its answer is incomplete
            return
        self._primary = status == "200"
        self.ledger.record(self.model, PRIMARY, self.cls, self._primary, ttft_s, tpot_s)
        self._compare()

    def shadow_finished(self, ok: bool, ttft_s: float | None, tpot_s: float | None, tokens: list[int]) -> None:
        if not self._current():
            return
        self._shadow = (ok, tokens)
        self.ledger.record(self.model, SHADOW, self.cls, ok, ttft_s, tpot_s)
        self._compare()

    def _compare(self) -> None:
        if not self.greedy or self._primary is None or self._shadow is None:
            return
        shadow_ok, shadow_tokens = self._shadow
        if self._primary and shadow_ok and self.primary_tokens:
            # the primary's answer may end early at a stop string: the candidate agrees when it said the same
            # tokens as far as the primary went
            p = self.primary_tokens
            self.ledger.compared(self.model, self.cls, shadow_tokens[:len(p)] == p)


class Mirror:
    def __init__(self, ledger: ShadowLedger, fleet: Fleet, pending: PendingRequests,
                 timeout_s: float | None) -> None:
        self.ledger = ledger
        self.fleet = fleet
        self.pending = pending
        self.timeout_s = timeout_s
        self.loop_lag_s = 0.0  # the last probe's lateness (`run`)
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Measure the event loop's lag (the gateway's lifespan task): how late a short sleep wakes up, while some
        model has a shadow (`tap` reads it only then); without one, look again every IDLE_CHECK_S."""
        while True:
            if not self.ledger.configs:
                await sleep_to_tick(IDLE_CHECK_S)
                continue
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            self.loop_lag_s = time.perf_counter() - t0 - LAG_PROBE_S

    def tap(self, prep: Prepared, decision: RouteDecision) -> Tap | None:
        """Start a copy of `prep` to the model's candidate when the shadow's rules allow; never awaits."""
        model = prep.model.model_id
        config = self.ledger.configs.get(model)
        if config is None or random.random() >= config.share:
            return None
        views = {v.worker_id: v for v in self.fleet.views()}
        served_by = views.get(decision.worker_id)
        if served_by is not None and config.holds(served_by):
            return None  # the candidate itself served it (a canary arm during the ramp): nothing to mirror
        if self.pending.count >= config.drop_above_pending * self.pending.limit:
            self.ledger.dropped(model, "load")
            return None
        if self.loop_lag_s * 1000 > config.max_loop_lag_ms:
            self.ledger.dropped(model, "lag")
            return None
        if self.ledger.in_flight[model] >= config.max_concurrency:
            self.ledger.dropped(model, "cap")
            return None
        candidates = [v for v in views.values() if v.model_id == model and v.healthy and not v.draining
                      and v.worker_id not in self.fleet.drained and config.holds(v)]
        capable = [v for v in candidates if prep.api.required_capabilities <= v.capabilities]  # as routing asks
        worker = self.fleet.get(min(capable, key=lambda v: v.load).worker_id) if capable else None
        if worker is None:  # "incapable": the candidate could not serve this request at all, the report says so
            self.ledger.dropped(model, "incapable" if candidates else "no_worker")
            return None
        tap = Tap(self.ledger, config, request_class(prep.api, prep.session_key, len(prep.prompt_ids)),
                  is_greedy(prep))
        message = to_pb(replace(prep, request_id=f"{prep.request_id}-shadow"))
        self.ledger.in_flight[model] += 1
        task = asyncio.create_task(self._copy(tap, worker, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return tap

    async def _copy(self, tap: Tap, worker, message) -> None:
        sent = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        tokens: list[int] = []
        ok = False
        stream = None
        try:
            stream = worker.client.generate(message)
            async with asyncio.timeout(self.timeout_s):
                async for msg in stream:
                    if msg.index != 0 or not msg.token_ids:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append((now - last) / len(msg.token_ids))
                    last = now
                    tokens.extend(msg.token_ids)
            ok = first is not None
        except (EngineCallError, TimeoutError) as e:
            log.info("shadow copy of %s on %s failed: %s", message.request_id, worker.worker_id, e)
        except Exception:  # a copy must never break the gateway: anything else is the candidate's error too
            log.exception("shadow copy of %s on %s failed", message.request_id, worker.worker_id)
        finally:
            if stream is not None:
                stream.cancel()
            self.ledger.in_flight[tap.model] -= 1
        tap.shadow_finished(ok, None if first is None else first - sent,
                            sum(gaps) / len(gaps) if gaps else None, tokens)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
