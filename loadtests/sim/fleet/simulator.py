"""`FleetSim`: one stack of simulated workers (loadtests/sim/fleet/engine.py) behind the real gateway's decisions,
run as a discrete-event loop over virtual time (no sleeping, no threads).

Events, in time order (ties in the order they were made): a request's arrival (the client's send), its
reaching the worker (`ROUTE`: after the gateway's FIFO, `GatewayPath.request_s` a request:
loadtests/sim/fleet/gateway_path.py; at once when that is 0), a worker's step boundary, the gateway's load poll
(every `GatewayPath.poll_interval_s`, when set), the pool planner's tick (every `tick_s`, as the gateway's
pool loop) and the end of a worker's kind switch. A token reaches the client `GatewayPath.token_s` after the
step that made it. When it reaches the gateway's routing the request is routed exactly as gateway/serving/generation.py routes it: its prompt's chained block
hashes (duet.hashing, HASH_BLOCK_TOKENS each, at most 256), a `RouteRequest` with the session key and turn count,
worker views (running, waiting, KV usage and the worker's measured prefill and decode rates, as GetLoad reports
them: live, or as the last poll saw them; the gateway's own queued-prefill count from
gateway/control/pool_tracker.PoolTracker), the request's traffic class by the gateway's rule
(duet.traffic_classes.classify), and the gateway's own `Router`
(gateway/serving/router.py) on the simulation's clock: its `decide` (`gateway.routing.policy.route`, or the
SGLang-style baseline `routing_baselines.SGLangRoute` for the homogeneous stacks, as `duet bench compare` runs
them) and its `record` (planner, SeenBlocks, WorkerBlockIndex); the session affinity is kept here. When a request
ends, the Router `observe`s its TTFT and TPOT as the client saw them (routing's learned latency correction). At a step boundary a worker first
delivers what its previous step produced (outputs stamped with the boundary's time; its KV events applied to
the gateway's index, as gateway/backends/fleet.py applies them), then runs its next real step; the step's modelled
seconds put the next boundary (longer by `neighbour_slowdown` when another worker is mid-step: workers sharing
one machine, as the local stack's do). A worker with nothing runnable idles until a request arrives.

With the planner (`planner=True`), each tick feeds `PoolTracker.tick` (gateway/control/pool_planner.py) the views;
when its target differs from the fleet, one worker at a time is switched as duet/pool_manager.py does: the
least busy worker of the kind with too many is drained (no new requests), and once empty it is gone for
`switch_s` (a restart as the other kind: weights load, caches start cold) and comes back as the other kind.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from duet.contract import ENGINE_KINDS, HASH_BLOCK_TOKENS, PAGED, PREFIX
from duet.hashing import block_hashes
from duet.traffic_classes import classify
from gateway.control.pool_planner import PlannerConfig
from gateway.control.pool_tracker import PoolTracker
from gateway.metrics import GatewayMetrics
from gateway.routing.policy import route
from gateway.routing.prefix_index import WorkerBlockIndex
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from gateway.serving.router import Router
from loadtests.sim.fleet.cost_models import for_engine
from loadtests.sim.fleet.engine import MODEL_ID, EngineProfile, SimEngine, make_request
from loadtests.sim.fleet.gateway_path import GatewayPath, GatewayQueue
from loadtests.sim.fleet.peer_policies import make_peer_policy
from loadtests.sim.fleet.workload import FleetRequest
from loadtests.sim.routing.baselines import SGLangRoute

MAX_HASH_BLOCKS = 256  # gateway/config.py max_hash_blocks
ARRIVE, STEP, TICK, BACK, ROUTE, POLL = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True)
class StackSpec:
    name: str
    kinds: tuple[str, ...]  # the workers' kinds at the start
    policy: str  # "duet" (gateway.routing.policy.route), "sglang" (the cache-aware baseline) or a peer's
    # (loadtests/sim/fleet/peer_policies.py: smg_cache_aware, vllm_kv_aware, llmd_default)
    planner: bool = False


@dataclass
class Served:
    """What the client saw of one request."""

    req: FleetRequest
    sent_s: float  # when the client sent it
    prompt_tokens: int
    worker_id: str = ""
    kind: str = ""
    reason: str = ""
    decision: object = None
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    cached_tokens: int = 0
    done: bool = False

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        return (self.last_s - self.first_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass
class SimSettings:
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    tick_s: float = 1.0
    switch_s: float = 20.0  # a worker restarting as the other kind (h200: loading 16 GB of weights)
    keep_step_log: bool = False
    chain_sessions: bool = True  # False: every turn at its own arrival time (an open-loop client, as --validate's)
    gateway: GatewayPath = field(default_factory=GatewayPath)  # zero cost and live views unless measured
    # workers sharing one machine's caches and memory bandwidth (the local stack, one worker per core): a step
    # that starts while another worker is mid-step takes this much longer (calibrate_neighbour.py); 0: apart
    neighbour_slowdown: float = 0.0


class FleetSim:
    def __init__(self, spec: StackSpec, requests: list[FleetRequest], cost_model, profile: EngineProfile,
                 settings: SimSettings | None = None) -> None:
        self.spec, self.requests, self.cost_model, self.profile = spec, requests, cost_model, profile
        self.s = settings or SimSettings()
        self.workers: dict[str, SimEngine] = {}
        self.generation = itertools.count()
        for i, kind in enumerate(spec.kinds):
            self._add_worker(kind, i)
        self.tracker = PoolTracker(GatewayMetrics(), self.s.planner)
        # the gateway's own Router: its decide and record, on this simulation's clock
        if spec.policy == "duet":
            policy = route
        elif spec.policy == "sglang":
            policy = SGLangRoute()
        else:
            policy = make_peer_policy(spec.policy, lambda: self.now)
        self.router = Router(self.views, WorkerBlockIndex(max(1, profile.kv_cache_tokens // HASH_BLOCK_TOKENS)),
                             policy=policy, pool_tracker=self.tracker, clock=lambda: self.now)
        # a peer that hashes the whole prompt (SMG's tree, vllm-router's tokenizer) gets every block, not the
        # gateway's head; one fed by the engines' KV events (vllm-router kv_aware) gets them as they come
        self.max_hash_blocks = None if getattr(policy, "full_prompt", False) else MAX_HASH_BLOCKS
        self.policy_kv_event = getattr(policy, "kv_event", None)
        self.index = self.router.index  # corrected by the workers' KV events, as the gateway's fleet does
        self.affinity: dict[str, str] = {}
        self.served: dict[str, Served] = {}
        self.backlog: dict[str, deque[FleetRequest]] = {}  # session -> turns waiting for the previous answer
        self.busy_sessions: set[str] = set()
        self.events: list = []
        self.order = itertools.count()
        self.sequence = itertools.count()
        self.now = 0.0
        self.switching: tuple[str, str] | None = None  # (worker id draining, kind it becomes)
        self.switches = 0
        self.unfinished = len(requests)
        self.kind_timeline: list[tuple[float, int, int]] = []
        self.gateway = GatewayQueue(self.s.gateway.request_s)
        self.sent_at: dict[str, float] = {}
        self.polled: dict[str, object] = {}  # worker id -> LoadStats at the last poll (poll_interval_s set)
        self.polled_rates: dict[str, tuple[float, float]] = {}  # worker id -> its prefill and decode rates then

    def _add_worker(self, kind: str, slot: int) -> SimEngine:
        wid = f"{kind}-{slot}-{next(self.generation)}"
        w = SimEngine.build(wid, kind, self.profile, for_engine(self.cost_model, kind), self.s.keep_step_log,
                            clock=lambda: self.now)
        self.workers[wid] = w
        return w

    def _push(self, t: float, what: int, payload) -> None:
        heapq.heappush(self.events, (t, next(self.order), what, payload))

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> list[Served]:
        for r in self.requests:
            self._push(r.arrival_s, ARRIVE, r)
        if self.spec.planner:
            self._push(self.s.tick_s, TICK, None)
        if self.s.gateway.poll_interval_s is not None:
            self._push(self.s.gateway.poll_phase_s, POLL, None)
        while self.events and self.unfinished > 0:
            t, _, what, payload = heapq.heappop(self.events)
            self.now = t
            if what == ARRIVE:
                self._arrive(payload)
            elif what == STEP:
                self._boundary(payload)
            elif what == ROUTE:
                self._dispatch(payload)
            elif what == TICK:
                self._tick()
                self._push(t + self.s.tick_s, TICK, None)
            elif what == POLL:
                self.polled = {wid: w.core.scheduler.load() for wid, w in self.workers.items()}
                self.polled_rates = {wid: (w.rates.prefill_tokens_per_s, w.rates.decode_tokens_per_s)
                                     for wid, w in self.workers.items()}
                self._push(t + self.s.gateway.poll_interval_s, POLL, None)
            else:
                self._back(*payload)
        return [self.served[r.request_id] for r in self.requests if r.request_id in self.served]

    def _arrive(self, req: FleetRequest) -> None:
        if req.session is not None and self.s.chain_sessions:
            if req.session in self.busy_sessions:
                self.backlog.setdefault(req.session, deque()).append(req)
                return
            self.busy_sessions.add(req.session)
        self._send(req, self.now)

    def _send(self, req: FleetRequest, sent_s: float) -> None:
        """The client sent `req` at `sent_s`; it reaches routing after the gateway's queue."""
        self.sent_at[req.request_id] = sent_s
        reach = self.gateway.admit(sent_s)
        if reach <= self.now:
            self._dispatch(req)
        else:
            self._push(reach, ROUTE, req)

    def views(self) -> list[WorkerView]:
        out = []
        for wid, w in self.workers.items():
            polled = self.polled.get(wid) if self.s.gateway.poll_interval_s is not None else None
            load = polled if polled is not None else w.core.scheduler.load()  # a worker newer than the poll: live
            prefill_rate, decode_rate = self.polled_rates.get(wid) if polled is not None and wid in self.polled_rates \
                else (w.rates.prefill_tokens_per_s, w.rates.decode_tokens_per_s)
            out.append(WorkerView(worker_id=wid, model_id=MODEL_ID, engine_kind=w.kind, version="v1",
                                  capabilities=frozenset(), healthy=True, draining=w.draining,
                                  num_running=load.num_running, num_waiting=load.num_waiting,
                                  kv_usage=load.kv_pages_used / max(1, load.kv_pages_total),
                                  queued_prefill_tokens=self.tracker.queued(wid),
                                  prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate))
        return out

    def _dispatch(self, req: FleetRequest) -> None:
        prompt = req.prompt(self.profile.max_model_len)
        hashes = tuple(block_hashes(prompt, HASH_BLOCK_TOKENS, MODEL_ID, max_blocks=self.max_hash_blocks))
        rr = RouteRequest(model=MODEL_ID, block_hashes=hashes, num_prompt_tokens=len(prompt), session_key=req.session,
                          turn_count=req.turn, sequence=next(self.sequence), block_tokens=HASH_BLOCK_TOKENS,
                          traffic_class=classify(structured=False, conversation=req.session is not None,
                                                 prompt_tokens=len(prompt)))
        decision = self.router.decide(rr, self.router.views(), self.s.routing, self.affinity.get(req.session))
        self.router.record(req.request_id, rr, decision)
        if req.session is not None:
            self.affinity[req.session] = decision.worker_id
        cached = min(decision.cached_blocks * HASH_BLOCK_TOKENS, len(prompt) - 1)
        self.tracker.prefill_started(req.request_id, decision.worker_id, len(prompt) - cached)
        w = self.workers[decision.worker_id]
        self.served[req.request_id] = Served(req, self.sent_at.pop(req.request_id, self.now), len(prompt),
                                             w.worker_id, w.kind, decision.reason, decision)
        w.core.add(make_request(req.request_id, prompt, req.max_tokens, arrival_s=self.now))
        if not w.stepping:
            w.stepping = True
            self._push(self.now, STEP, w.worker_id)

    def _boundary(self, wid: str) -> None:
        w = self.workers[wid]
        if w.pending is not None:
            self._deliver(w, w.pending)
            w.pending = None
        if w.core.has_unfinished():
            neighbour_busy = any(o.pending is not None for o in self.workers.values() if o is not w)
            result, seconds = w.step()
            if neighbour_busy:
                seconds *= 1.0 + self.s.neighbour_slowdown
            if result.ran_model:
                w.pending = result
                self._push(self.now + seconds, STEP, wid)
                return
            self._deliver(w, result)  # nothing ran (errors only, or nothing runnable): idle until an arrival
        w.stepping = False
        if w.draining and not w.core.has_unfinished():
            self._retire(w)

    def _deliver(self, w: SimEngine, result) -> None:
        for ev in result.kv_events:
            self.index.apply_kv_event(w.worker_id, ev.kind, list(ev.block_hashes))
            if self.policy_kv_event is not None:
                self.policy_kv_event(w.worker_id, ev.kind, list(ev.block_hashes))
        for out in result.outputs:
            s = self.served.get(out.request_id)
            if s is None or s.done:
                continue
            if out.cached_tokens is not None:
                s.cached_tokens = out.cached_tokens
            if out.token_ids:
                seen = self.now + self.s.gateway.token_s  # when the client has it
                if s.first_s is None:
                    s.first_s = seen
                    self.tracker.prefill_done(out.request_id)
                s.tokens += len(out.token_ids)
                s.last_s = seen
            if out.finish_reason is not None:
                self._finished(s)

    def _finished(self, s: Served) -> None:
        s.done = True
        if s.first_s is None:  # ended without a token (an engine error): counted as missing its SLO
            s.first_s = s.last_s = self.now
            self.tracker.prefill_done(s.req.request_id)
        self.unfinished -= 1
        self.router.observe(s.decision, s.ttft_s, s.tpot_s if s.tokens > 1 else None)
        self.tracker.finished(self.now, s.decision, HASH_BLOCK_TOKENS, s.prompt_tokens, s.cached_tokens, s.tokens)
        session = s.req.session
        if session is not None and self.s.chain_sessions:
            queue = self.backlog.get(session)
            if queue:
                self._send(queue.popleft(), self.now + self.s.gateway.token_s)  # the user read the answer
            else:
                self.busy_sessions.discard(session)

    # -- the pool planner -------------------------------------------------------------------------
    def _tick(self) -> None:
        views = self.views()
        target = self.tracker.tick(self.now, views)
        counts = {k: sum(1 for w in self.workers.values() if w.kind == k) for k in ENGINE_KINDS}
        self.kind_timeline.append((self.now, counts[PAGED], counts[PREFIX]))
        if self.switching is not None:
            return
        surplus = next((k for k in ENGINE_KINDS if counts[k] > target.get(k, 0)), None)
        if surplus is None:
            return
        other = PREFIX if surplus == PAGED else PAGED
        if counts[other] >= target.get(other, 0) and sum(counts.values()) <= sum(target.values()):
            return
        w = min((w for w in self.workers.values() if w.kind == surplus),
                key=lambda w: (w.core.scheduler.load().num_running + w.core.scheduler.load().num_waiting,
                               w.worker_id))
        w.draining = True
        self.switching = (w.worker_id, other)
        if not w.stepping and not w.core.has_unfinished():
            self._retire(w)

    def _retire(self, w: SimEngine) -> None:
        if self.switching is None or self.switching[0] != w.worker_id:
            return
        del self.workers[w.worker_id]
        self.index.remove_worker(w.worker_id)
        self.router.forget(w.worker_id)
        slot = int(w.worker_id.split("-")[1])
        self._push(self.now + self.s.switch_s, BACK, (self.switching[1], slot))

    def _back(self, kind: str, slot: int) -> None:
        self._add_worker(kind, slot)
        self.switching = None
        self.switches += 1
