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
4. affinity    - the session's previous worker, kept unless unhealthy, overloaded, or another
                 worker's prefill wait is `shed_tokens` shorter (then this session alone moves);
5. engine      - a cost per kind: the preferred kind (estimated reuse, leading blocks seen
                 recently / head blocks, >= threshold, or a session / multi-turn chat -> prefix,
                 else paged) is a bias of up to `spill_tokens`; a worker holding the prompt's
                 prefix saves its re-prefill and a second copy, so a conversation's second turn or
                 a shared prompt's second request stays where its prefix is (`prefix_held`) unless
                 moving pays; a far busier wanted pool gives its work away (`spill`);
6. replica     - the cheapest worker (cost: queued prefill tokens + this prompt's uncached tokens
                 + `request_tokens` per request in flight); an anonymous prompt keeps to the worker
                 caching most of it unless that one's prefill wait is `shed_tokens` longer;
7. decision    - the worker plus the reason, one of REASONS (a metric label).

`capable` is steps 1-3 as a list (empty when no worker can serve the request): the one answer to "which
workers can serve this" that routing, admission and dispatch's wait for a circuit breaker all use.
`eligible` is steps 1-3 alone: the benchmarks' baseline policies (loadtests/sim/routing/baselines.py),
which the gateway runs in place of `route` when its config names one (`routing_policy`), share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from duet.contract import PAGED, PAGED_CAPABILITIES, PREFIX, PREFIX_CAPABILITIES
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
    if affinity_worker is not None:
        kept = next((w for w in in_variant if w.worker_id == affinity_worker), None)
        if kept is not None:
            others = [c for wid, c in waits.items() if wid != kept.worker_id]
            if not _overloaded(kept, config) and (
                    not others or waits[kept.worker_id] - min(others) <= config.shed_tokens):
                steps.append("affinity")
                # the kind the session prefers is its demand, also while it stays on a worker of the other
                # kind (it spilled there, or stayed where its prefix was): the planner counts it there
                return _decide(kept, variant, reuse, index, req, steps, _preferred(req, reuse, config, steps,
                                                                                   in_variant)[0])
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
            waits[home.worker_id] - waits[cheapest.worker_id] <= config.shed_tokens):
        worker = home
    else:
        worker = cheapest
    steps.append("cache_match" if cached[worker.worker_id] > min(cached[w.worker_id] for w in pool)
                 else "least_load")

    # 7. decision
    return _decide(worker, variant, reuse, index, req, steps, first_choice)


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
    req: RouteRequest, steps: list[str], wanted_kind: str = "",
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
    )
