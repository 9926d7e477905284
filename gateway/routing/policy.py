"""Duet's routing policy: a pure function from a request and a snapshot of the workers to one
worker. No I/O; the caller supplies the affinity lookup and the two prefix tables, and after
the decision records it (`seen.add(req.block_hashes)`; `index.add(decision.worker_id,
req.block_hashes)`; the session's affinity). Its types and errors are in gateway/routing/route_types.py.

The seven steps, in order (docs/routing.md explains each and every default):

1. candidates  - workers serving the model, healthy, not draining;
2. capability  - structured output / speculative decoding need engine_prefix, n > 1 and beam
                 search need engine_paged; no capable worker -> NoCapableWorker (503);
3. variant     - canary arm, sticky by the hash of the session or user key, or the
                 operator's override (unknown name -> UnknownVariant, 400): gateway/routing/canary.py;
4. affinity    - the session's previous worker, kept unless unhealthy, overloaded, or saturated: sticky
                 until saturated (below), then this session alone moves;
5. engine      - a cost per kind: the preferred kind (estimated reuse, leading blocks seen
                 recently / head blocks, >= threshold, or a session / multi-turn chat -> prefix,
                 else paged) is a bias of up to `spill_tokens`; a worker holding the prompt's
                 prefix saves its re-prefill and a second copy, so a conversation's second turn or
                 a shared prompt's second request stays where its prefix is (`prefix_held`) unless
                 moving pays; a far busier wanted pool gives its work away (`spill`);
6. replica     - the cheapest worker (cost: queued prefill tokens + this prompt's uncached tokens
                 + `request_tokens` per request in flight, over the worker's prefill rate); an anonymous
                 prompt keeps to the worker caching most of it unless that one is saturated;
7. decision    - the worker plus the reason, one of REASONS (a metric label).

Predicted latency and saturation (issue 45; docs/architecture.md says why, after llm-d's "sticky until
saturated"). A worker's predicted TTFT for this request is its prefill wait (the prefill queued there plus the
prompt tokens it does not hold) over its measured prefill rate (`WorkerView.prefill_tokens_per_s`: the engine's
own figure, else the one this gateway observed; a worker with none is taken to be as fast as the mean of the
measured ones), plus the decode the engine interleaves with that prefill: every step of it (at most
`step_tokens` of the wait a step) also decodes one token of each running sequence, at the worker's measured
decode rate. So a holder with a large decode batch looks as busy as it is, not only its prefill queue. Its
predicted TPOT is its batch with this request over its measured decode rate. Each is then scaled by what this
gateway learned of the model's error on that worker (`WorkerView.ttft_correction`, `tpot_correction`: observed
over predicted of its recent requests, gateway/routing/calibration.py), so a cost the model leaves out (a vLLM
step's prefill chunk stalling its decodes, a shared core) is learned rather than modelled. The worker holding a
request's prefix (the session's, or the one caching most of an anonymous prompt) keeps it until it is
saturated: its predicted TTFT passes `saturation_share` of the request's class TTFT bound
(duet/traffic_classes.py at `slo_profile`), or its predicted TPOT the class TPOT bound; then the request goes
where it starts sooner. With no class or no measured rate there is nothing to predict from, and the holder keeps
the request unless another worker's prefill wait is `shed_tokens` shorter (the fixed margin of before). The
replica cost of step 6 is in tokens, not scaled by the measured rates: a measured prefill rate follows a worker's
step mix as much as its speed (32 identical simulated H200 workers read 15,000 to 33,000 tokens/s at once), and
scaling the cost by it cost goodput in the fleet simulator (docs/benchmarks.md, 2026-12-06 evening); the rates
act through the saturation test, where a slower worker's longer predicted TTFT sheds its requests sooner.

`capable` is steps 1-3 as a list (empty when no worker can serve the request): the one answer to "which
workers can serve this" that routing, admission and dispatch's wait for a circuit breaker all use.
`eligible` is steps 1-3 alone: the benchmarks' baseline policies (loadtests/sim/routing/baselines.py),
which the gateway runs in place of `route` when its config names one (`routing_policy`), share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from duet.contract import PAGED, PAGED_CAPABILITIES, PREFIX, PREFIX_CAPABILITIES
from duet.traffic_classes import bound_of
from gateway.routing.canary import pick_variant
from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import (
    NoCapableWorker,
    RouteDecision,
    RouteRequest,
    RoutingConfig,
    UnknownVariant,
    WorkerView,
)


class Eligible(NamedTuple):
    """Steps 1-3: the canary arm and its capable candidates, and the steps that applied."""

    variant: str
    workers: list[WorkerView]
    steps: list[str]


def eligible(req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig) -> Eligible:
    """Candidates (1), capability (2) and canary variant (3); raises NoCapableWorker or UnknownVariant."""
    steps: list[str] = []
    candidates = [w for w in workers if w.model_id == req.model and w.healthy and not w.draining]
    if not candidates:
        raise NoCapableWorker(f"no healthy worker serves model {req.model!r}")
    candidates, forced_kind = _capable(candidates, req.required_capabilities)
    if forced_kind is not None:
        steps.append("capability")
    variant, in_variant = pick_variant(req, candidates, config)
    if req.variant_override is not None:
        steps.append("override")
    return Eligible(variant, in_variant, steps)


def capable(req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig) -> list[WorkerView]:
    """The workers routing may pick for `req` (steps 1-3: its model, healthy, not draining, its capabilities,
    its canary arm); empty when there is none or its variant override names no variant."""
    try:
        return eligible(req, workers, config).workers
    except (NoCapableWorker, UnknownVariant):
        return []


def route(
    req: RouteRequest,
    workers: Sequence[WorkerView],
    config: RoutingConfig,
    affinity_worker: str | None,
    seen: SeenBlocks,
    index: WorkerBlockIndex,
) -> RouteDecision:
    """Choose a worker for `req` (steps 1-7 of the module docstring)."""
    variant, in_variant, steps = eligible(req, workers, config)  # steps 1-3
    reuse = seen.estimated_reuse(req.block_hashes)

    # 4. session affinity, shed per session: the session's worker is kept unless it is overloaded or
    # another worker would serve this turn `shed_tokens` sooner even after re-prefilling the history
    cached = {w.worker_id: index.match(w.worker_id, req.block_hashes) for w in in_variant}
    waits = {w.worker_id: _prefill_wait(w, req, cached[w.worker_id]) for w in in_variant}
    costs = {w.worker_id: waits[w.worker_id] + config.request_tokens * _load(w, config) for w in in_variant}
    latency = Latency.predict(req, in_variant, config, waits)
    if affinity_worker is not None:
        kept = next((w for w in in_variant if w.worker_id == affinity_worker), None)
        if kept is not None:
            others = [w for w in in_variant if w.worker_id != kept.worker_id]
            if not _overloaded(kept, config) and _holds(kept, others, waits, latency, config):
                steps.append("affinity")
                # the kind the session prefers is its demand, also while it stays on a worker of the other
                # kind (it spilled there, or stayed where its prefix was): the planner counts it there
                return _decide(kept, variant, reuse, index, req, steps, _preferred(req, reuse, config, steps,
                                                                                   in_variant)[0], latency)
            steps.append("shed")

    # 5. engine kind: the reuse estimate names the kind this request suits, and that preference is a
    # bias in a cost per kind, not a rule: moving a prompt off the worker that holds its prefix costs
    # that prefix's re-prefill and a second copy of it in the fleet (`_kind_cost`)
    kinds = {w.engine_kind for w in in_variant}
    wanted, engine_reason = _preferred(req, reuse, config, steps, in_variant)
    first_choice = wanted
    if wanted not in kinds:
        wanted = next(iter(kinds))  # the variant has one kind only: it serves everything
    elif len(kinds) > 1:
        steps.append(engine_reason)  # the reuse estimate really chose between two kinds
        other = PAGED if wanted == PREFIX else PREFIX
        held = max(cached.values())
        best = {k: min(_kind_cost(w, req, config, costs[w.worker_id], cached[w.worker_id], held, first_choice)
                       for w in in_variant if w.engine_kind == k) for k in (wanted, other)}
        if best[other] < best[wanted]:
            # the kind not preferred costs less: either it holds this prompt's prefix (a paged
            # worker that served a conversation's first turn serves its second from its cache), or the
            # wanted pool is far busier (queueing behind a saturated pool is what hurts the TTFT tail;
            # sessions spill too: affinity then keeps their later turns on the worker holding the history)
            holds_more = (max(cached[w.worker_id] for w in in_variant if w.engine_kind == other)
                          > max(cached[w.worker_id] for w in in_variant if w.engine_kind == wanted))
            wanted = other
            steps.append("prefix_held" if holds_more else "spill")
    pool = [w for w in in_variant if w.engine_kind == wanted]

    # 6. replica: the cheapest worker (cost: prefill wait + in-flight requests; ties, as in an idle fleet,
    # rotate with the request counter so they do not all land on one worker). A prompt without a session
    # key keeps to the worker holding most of it while that one's prefill wait is within `shed_tokens` of
    # the cheapest's: the affinity rule, for anonymous clients. A new session takes the cheapest (sharing a
    # document with another session is no reason to queue behind it).
    turn = {w.worker_id: i for i, w in enumerate(sorted(pool, key=lambda w: w.worker_id))}
    cheapest = min(pool, key=lambda w: (costs[w.worker_id], _load(w, config),
                                        (turn[w.worker_id] - req.sequence) % len(pool)))
    home = max(pool, key=lambda w: (cached[w.worker_id], -costs[w.worker_id]))
    if req.session_key is None and cached[home.worker_id] > min(cached[w.worker_id] for w in pool) and (
            _holds(home, [cheapest], waits, latency, config)):
        worker = home
    else:
        worker = cheapest
    steps.append("cache_match" if cached[worker.worker_id] > min(cached[w.worker_id] for w in pool)
                 else "least_load")

    # 7. decision
    return _decide(worker, variant, reuse, index, req, steps, first_choice, latency)


class Latency(NamedTuple):
    """Each candidate's predicted TTFT and TPOT (seconds) for one request, and the class bounds they are held to.

    `ttft_s` and `tpot_s` are the predictions routing uses (the model's figures times each worker's learned
    correction); `modelled_*` the model's own, which the gateway compares with what the request then saw."""

    ttft_s: dict[str, float]
    tpot_s: dict[str, float | None]  # None: no measured decode rate
    ttft_bound_s: float | None  # the request's class bound (None: no class known)
    tpot_bound_s: float | None
    modelled_ttft_s: dict[str, float]
    modelled_tpot_s: dict[str, float | None]

    @classmethod
    def predict(cls, req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig,
                waits: dict[str, int]) -> Latency | None:
        """None when no candidate has a measured prefill rate (nothing to predict from)."""
        measured = [w.prefill_tokens_per_s for w in workers if w.prefill_tokens_per_s > 0]
        if not measured:
            return None
        mean = sum(measured) / len(measured)
        # a worker not measured yet is taken to be as fast as the mean of those measured
        rates = {w.worker_id: w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else mean for w in workers}
        ttft, tpot = {}, {}
        for w in workers:
            wid, wait = w.worker_id, waits[w.worker_id]
            # one step's decode: the running batch over the batch's measured token rate (the gap between two of
            # this request's tokens once it joins: an upper estimate where a larger batch steps no slower)
            step_decode_s = w.num_running / w.decode_tokens_per_s if w.decode_tokens_per_s > 0 else 0.0
            # the prefill wait, and the decode the engine interleaves with it: every step that prefills part of
            # the wait (at most `step_tokens` of it) also decodes one token of each running sequence
            ttft[wid] = wait / rates[wid] + -(-max(wait, 1) // config.step_tokens) * step_decode_s
            tpot[wid] = (w.num_running + 1) / w.decode_tokens_per_s if w.decode_tokens_per_s > 0 else None
        correction = {w.worker_id: (w.ttft_correction, w.tpot_correction) for w in workers}
        bound = bound_of(req.traffic_class, config.slo_profile) if req.traffic_class else None
        return cls({wid: t * correction[wid][0] for wid, t in ttft.items()},
                   {wid: t * correction[wid][1] if t is not None else None for wid, t in tpot.items()},
                   bound.ttft_bound_ms(req.num_prompt_tokens) / 1000 if bound else None,
                   bound.itl_ms / 1000 if bound else None, ttft, tpot)

    def saturated(self, worker_id: str, config: RoutingConfig) -> bool:
        """The worker would serve this request past `saturation_share` of its TTFT bound, or past its TPOT bound."""
        tpot = self.tpot_s[worker_id]
        return self.ttft_s[worker_id] > config.saturation_share * self.ttft_bound_s or (
            tpot is not None and tpot > self.tpot_bound_s)


def _holds(holder: WorkerView, others: Sequence[WorkerView], waits: dict[str, int], latency: Latency | None,
           config: RoutingConfig) -> bool:
    """Whether the worker holding a request's prefix keeps it against `others`: sticky until saturated (module
    doc); without a prediction, unless another's prefill wait is `shed_tokens` shorter."""
    if not others:
        return True
    wid = holder.worker_id
    if latency is None or latency.ttft_bound_s is None:
        return waits[wid] - min(waits[w.worker_id] for w in others) <= config.shed_tokens
    if not latency.saturated(wid, config):
        return True
    # saturated: it moves where it would be served within its bounds or start sooner; elsewhere moving loses the
    # cache and gains nothing
    return not any(not latency.saturated(w.worker_id, config) or latency.ttft_s[w.worker_id] < latency.ttft_s[wid]
                   for w in others)


def _capable(
    candidates: list[WorkerView], required: frozenset[str]
) -> tuple[list[WorkerView], str | None]:
    """Workers advertising every required capability, narrowed to the engine kind that serves
    them best when one exists (structured output -> prefix, n/beam -> paged)."""
    capable = [w for w in candidates if required <= w.capabilities]
    wants_prefix = bool(required & PREFIX_CAPABILITIES)
    wants_paged = bool(required & PAGED_CAPABILITIES)
    if not capable:
        # the fleet may have no worker of the kind that serves it (the pool planner may choose a
        # homogeneous fleet; it brings one back while such requests arrive: gateway/control/pool_planner.py)
        served_by = ("; engine_prefix serves it" if wants_prefix and not wants_paged else
                     "; engine_paged serves it" if wants_paged and not wants_prefix else "")
        raise NoCapableWorker(
            f"no healthy worker supports {', '.join(sorted(required))} for this model{served_by}"
        )
    if wants_prefix == wants_paged:  # neither, or both (then any worker advertising both)
        return capable, None
    kind = PREFIX if wants_prefix else PAGED
    preferred = [w for w in capable if w.engine_kind == kind]
    return (preferred, kind) if preferred else (capable, None)


def _load(w: WorkerView, config: RoutingConfig) -> float:
    """Requests in flight, a queued one weighted: it waits behind a prefill, a running one
    mostly shares the batch."""
    return w.num_running + config.waiting_weight * w.num_waiting


def _prefill_wait(w: WorkerView, req: RouteRequest, cached_blocks: int) -> int:
    """Prefill tokens `req` would wait for on `w`: the prefill queued there plus this prompt's tokens
    the worker does not hold. Its first token comes about this many tokens of prefill time from now.

    Duet's cost adds `request_tokens` per request in flight (a running request shares the decode batch
    and holds KV); choosing by cost balances the fleet, shedding by wait protects the TTFT tail."""
    return w.queued_prefill_tokens + max(0, req.num_prompt_tokens - cached_blocks * req.block_tokens)


def _preferred(req: RouteRequest, reuse: float, config: RoutingConfig, steps: list[str],
               in_variant: list[WorkerView]) -> tuple[str, str]:
    """The engine kind `req` suits, and the step that says so (the bias of step 5)."""
    if "capability" in steps:  # the capability chose the kind (all candidates are of it)
        return in_variant[0].engine_kind, "capability"
    # A session key says more turns will resend this prompt, so even its first turn goes where the
    # history will be cached (affinity keeps the later turns there).
    if req.turn_count > 1 or req.session_key is not None:
        return PREFIX, "multi_turn"
    if reuse >= config.reuse_threshold and reuse > 0.0:
        return PREFIX, "reuse_high"
    return PAGED, "reuse_low"


def _kind_cost(w: WorkerView, req: RouteRequest, config: RoutingConfig, cost: float, cached_blocks: int,
               held_blocks: int, preferred: str) -> float:
    """What serving `req` on `w` costs when choosing the engine kind, in prefill tokens: its replica cost
    (the prefill wait, which counts the re-prefill of any prefix `w` lacks, plus the load), a second
    copy in the fleet of the prefix another worker already holds (`held_blocks`: cache room another
    prefix loses, so about one more re-prefill later), and the kind bias: `spill_tokens` on a worker
    of the other kind, in proportion to the share of the prompt that worker must prefill (the kind
    matters for the work an engine takes on: the prefill it schedules and the blocks it adds to its
    cache; a worker that holds most of the prompt takes on little)."""
    copy = (held_blocks - cached_blocks) * req.block_tokens
    if w.engine_kind == preferred or req.num_prompt_tokens <= 0:
        return cost + copy
    uncached = max(0, req.num_prompt_tokens - cached_blocks * req.block_tokens)
    return cost + copy + config.spill_tokens * uncached / req.num_prompt_tokens


def _overloaded(w: WorkerView, config: RoutingConfig) -> bool:
    return _load(w, config) >= config.overload_running or w.kv_usage >= config.overload_kv_usage


# the most decisive step names the decision: an operator action first, then hard constraints,
# then what overrode the cache-first choice, then the engine choice, then the replica choice
_PRECEDENCE = (
    "override", "capability", "affinity", "shed", "prefix_held", "spill", "multi_turn", "reuse_high", "reuse_low",
    "cache_match", "least_load",
)


def _decide(
    w: WorkerView, variant: str, reuse: float, index: WorkerBlockIndex,
    req: RouteRequest, steps: list[str], wanted_kind: str = "", latency: Latency | None = None,
) -> RouteDecision:
    reason = next(r for r in _PRECEDENCE if r in steps)
    return RouteDecision(
        worker_id=w.worker_id,
        engine_kind=w.engine_kind,
        variant=variant,
        reason=reason,
        estimated_reuse=reuse,
        cached_blocks=index.match(w.worker_id, req.block_hashes),
        steps=tuple(steps),
        wanted_kind=wanted_kind,
        predicted_ttft_s=latency.ttft_s[w.worker_id] if latency is not None else None,
        predicted_tpot_s=latency.tpot_s[w.worker_id] if latency is not None else None,
        modelled_ttft_s=latency.modelled_ttft_s[w.worker_id] if latency is not None else None,
        modelled_tpot_s=latency.modelled_tpot_s[w.worker_id] if latency is not None else None,
    )
