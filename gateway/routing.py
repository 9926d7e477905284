"""The routing policy: a pure function from a request and a snapshot of the workers to one
worker. No I/O; the caller supplies the affinity lookup and the two prefix tables, and after
the decision records it (`seen.add(req.block_hashes)`; `index.add(decision.worker_id,
req.block_hashes)`; the session's affinity).

The seven steps, in order (docs/routing.md explains each and every default):

1. candidates  - workers serving the model, healthy, not draining;
2. capability  - structured output / speculative decoding need engine_prefix, n > 1 and beam
                 search need engine_paged; no capable worker -> NoCapableWorker (503);
3. variant     - canary arm, sticky by the hash of the session or user key, or the
                 operator's override (unknown name -> UnknownVariant, 400);
4. affinity    - the session's previous worker, kept unless unhealthy, overloaded, or another
                 worker's prefill wait is `shed_tokens` shorter (then this session alone moves);
5. engine      - estimated reuse (leading blocks seen recently / head blocks) >= threshold,
                 or a session / multi-turn chat -> prefix, else paged; the other kind if one is
                 missing, or if its cheapest worker costs `spill_tokens` less (a spill);
6. replica     - the cheapest worker (cost: queued prefill tokens + this prompt's uncached tokens
                 + `request_tokens` per request in flight); an anonymous prompt keeps to the worker
                 caching most of it unless that one's prefill wait is `shed_tokens` longer;
7. decision    - the worker plus the reason, one of REASONS (a metric label).

`RoutingConfig.policy` keeps steps 1-3 and swaps the rest, for baselines (`duet bench compare`):
"duet" (default) runs all seven; "cache_aware" skips 4 and 5 (replica by cache match and load
over every candidate, as SGLang's router does); "round_robin" takes the candidates in turn by
`RouteRequest.sequence` (the caller's request counter), ignoring cache and load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from gateway.canary import pick_weighted, sticky_point
from gateway.prefix_index import SeenBlocks, WorkerBlockIndex

PAGED = "paged"
PREFIX = "prefix"
ENGINE_KINDS = (PAGED, PREFIX)

# capability name (as workers advertise it in GetInfo) -> the engine kind that serves it best
PREFIX_CAPABILITIES = frozenset({"structured_output", "speculative"})
PAGED_CAPABILITIES = frozenset({"n", "beam_search"})

REASONS = (
    "capability", "affinity", "shed", "spill", "reuse_high", "reuse_low", "multi_turn",
    "cache_match", "least_load", "imbalance", "override", "round_robin",
)
POLICIES = ("duet", "cache_aware", "round_robin")


class NoCapableWorker(Exception):
    """No healthy worker can serve this request (maps to HTTP 503)."""


class UnknownVariant(Exception):
    """The operator's variant override names no configured variant (maps to HTTP 400)."""


class RoutingConfigError(ValueError):
    """A routing config that cannot be applied (bad weights, unknown engine kind...)."""


@dataclass(frozen=True)
class WorkerView:
    """A snapshot of one worker as the gateway last saw it."""

    worker_id: str
    model_id: str
    engine_kind: str
    version: str
    capabilities: frozenset[str]
    healthy: bool
    draining: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    queued_prefill_tokens: int = 0  # uncached prompt tokens routed here still before their first token

    @property
    def load(self) -> int:
        """Requests in flight on the worker (running + queued)."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class Pool:
    """Workers of one engine kind and one deploy version label ("*" matches any version)."""

    engine_kind: str
    version: str = "*"

    def holds(self, w: WorkerView) -> bool:
        return w.engine_kind == self.engine_kind and self.version in ("*", w.version)


@dataclass(frozen=True)
class Variant:
    """One canary arm: a set of pools and its share of the traffic."""

    name: str
    pools: tuple[Pool, ...]
    weight: float


@dataclass(frozen=True)
class RoutingConfig:
    """Per-model routing knobs. Defaults are justified in docs/routing.md."""

    variants: tuple[Variant, ...] = ()  # empty: one implicit variant "default" of all pools
    sticky_key: str = "session"  # "session" | "user": what keeps a client in one canary arm
    reuse_threshold: float = 0.5  # estimated reuse at or above it -> engine_prefix
    overload_running: int = 48  # affinity is dropped at this many requests in flight ...
    overload_kv_usage: float = 0.95  # ... or at this KV usage
    load_penalty: float = 1.0  # cached blocks one extra in-flight request is worth
    imbalance_ratio: float = 1.5  # guard fires when max load > ratio * min load ...
    imbalance_abs: int = 8  # ... and max load - min load > this many requests
    waiting_weight: float = 1.0  # a queued request counts as this many in flight (load = running + w * waiting)
    request_tokens: int = 256  # duet's cost: one request in flight weighs as much as this many prefill tokens
    shed_tokens: int = 98304  # a session leaves its worker when another's prefill wait is shorter by this many tokens
    spill_tokens: int = 4096  # a new prompt goes to the other engine kind when its cost is lower by this many
    policy: str = "duet"  # "duet" | "cache_aware" | "round_robin" (baselines; module docstring)

    def validate(self) -> RoutingConfig:
        """Return self, or raise RoutingConfigError with what is wrong."""
        # NaN passes every range check below and Infinity breaks the JSON the admin API answers with
        numbers = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), float)}
        numbers.update({f"variant {v.name!r} weight": v.weight for v in self.variants})
        for name, value in numbers.items():
            if not math.isfinite(value):
                raise RoutingConfigError(f"{name} must be a finite number, got {value}")
        if self.policy not in POLICIES:
            raise RoutingConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.sticky_key not in ("session", "user"):
            raise RoutingConfigError(f"sticky_key must be 'session' or 'user', got {self.sticky_key!r}")
        if not 0.0 <= self.reuse_threshold <= 1.0:
            raise RoutingConfigError(f"reuse_threshold must be in [0, 1], got {self.reuse_threshold}")
        if self.overload_running < 1 or self.imbalance_abs < 0 or self.imbalance_ratio < 1.0:
            raise RoutingConfigError("overload_running >= 1, imbalance_abs >= 0, imbalance_ratio >= 1 required")
        if min(self.request_tokens, self.shed_tokens, self.spill_tokens) < 0:
            raise RoutingConfigError("request_tokens, shed_tokens and spill_tokens must be >= 0")
        if self.load_penalty < 0 or self.waiting_weight < 0:
            raise RoutingConfigError("load_penalty and waiting_weight must be >= 0")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise RoutingConfigError(f"variant names must be unique, got {names}")
        for v in self.variants:
            if v.weight < 0 or not v.pools:
                raise RoutingConfigError(f"variant {v.name!r} needs weight >= 0 and at least one pool")
            for p in v.pools:
                if p.engine_kind not in ENGINE_KINDS:
                    raise RoutingConfigError(f"variant {v.name!r}: unknown engine kind {p.engine_kind!r}")
        if self.variants and not any(v.weight > 0 for v in self.variants):
            raise RoutingConfigError("at least one variant needs a positive weight")
        return self


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs to know about one request."""

    model: str
    block_hashes: tuple[int, ...]  # chained hashes of the prompt head (full blocks)
    num_prompt_tokens: int
    session_key: str | None = None
    user_key: str | None = None
    required_capabilities: frozenset[str] = frozenset()
    variant_override: str | None = None
    turn_count: int = 1  # user messages in the chat; > 1 means multi-turn
    sequence: int = 0  # the caller's count of routed requests (the round_robin policy)
    block_tokens: int = 16  # tokens per hashed block (cached blocks -> cached tokens in duet's cost)


@dataclass(frozen=True)
class RouteDecision:
    """The chosen worker and why. `reason` is the most decisive step (see REASONS);
    `steps` lists every step's outcome, for logs and the simulator."""

    worker_id: str
    engine_kind: str
    variant: str
    reason: str
    estimated_reuse: float
    cached_blocks: int
    steps: tuple[str, ...] = field(default=())
    wanted_kind: str = ""  # the kind step 5 chose, before a spill or a missing kind changed it ("": none)


DEFAULT_VARIANT = "default"


def route(
    req: RouteRequest,
    workers: Sequence[WorkerView],
    config: RoutingConfig,
    affinity_worker: str | None,
    seen: SeenBlocks,
    index: WorkerBlockIndex,
) -> RouteDecision:
    """Choose a worker for `req` (steps 1-7 of the module docstring)."""
    steps: list[str] = []
    # 1. candidates
    candidates = [w for w in workers if w.model_id == req.model and w.healthy and not w.draining]
    if not candidates:
        raise NoCapableWorker(f"no healthy worker serves model {req.model!r}")

    # 2. capability
    candidates, forced_kind = _capable(candidates, req.required_capabilities)
    if forced_kind is not None:
        steps.append("capability")

    # 3. canary variant
    variant, in_variant = _pick_variant(req, candidates, config)
    if req.variant_override is not None:
        steps.append("override")

    reuse = seen.estimated_reuse(req.block_hashes)
    if config.policy == "round_robin":
        steps.append("round_robin")
        in_turn = sorted(in_variant, key=lambda w: w.worker_id)[req.sequence % len(in_variant)]
        return _decide(in_turn, variant, reuse, index, req, steps)
    if config.policy == "cache_aware":
        worker, replica_reason = _pick_replica(in_variant, req.block_hashes, config, index)
        steps.append(replica_reason)
        return _decide(worker, variant, reuse, index, req, steps)

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
                return _decide(kept, variant, reuse, index, req, steps)
            steps.append("shed")

    # 5. engine kind by estimated reuse
    kinds = {w.engine_kind for w in in_variant}
    # A session key says more turns will resend this prompt, so even its first turn goes where the
    # history will be cached (affinity keeps the later turns there).
    if req.turn_count > 1 or req.session_key is not None:
        wanted, engine_reason = PREFIX, "multi_turn"
    elif reuse >= config.reuse_threshold and reuse > 0.0:
        wanted, engine_reason = PREFIX, "reuse_high"
    else:
        wanted, engine_reason = PAGED, "reuse_low"
    first_choice = wanted
    if wanted not in kinds:
        wanted = next(iter(kinds))  # the variant has one kind only: it serves everything
    elif len(kinds) > 1:
        steps.append(engine_reason)  # the reuse estimate really chose between two kinds
        other = PAGED if wanted == PREFIX else PREFIX
        best = {k: min(costs[w.worker_id] for w in in_variant if w.engine_kind == k) for k in (wanted, other)}
        if best[other] + config.spill_tokens < best[wanted]:
            # the wanted pool is far busier: both engines cache prefixes and serve any prompt, and
            # queueing behind a saturated pool is what hurts the TTFT tail (sessions spill too: affinity
            # then keeps their later turns on the worker that now holds the history)
            wanted = other
            steps.append("spill")
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
    if not capable:
        raise NoCapableWorker(
            f"no healthy worker supports {', '.join(sorted(required))} for this model"
        )
    wants_prefix = bool(required & PREFIX_CAPABILITIES)
    wants_paged = bool(required & PAGED_CAPABILITIES)
    if wants_prefix == wants_paged:  # neither, or both (then any worker advertising both)
        return capable, None
    kind = PREFIX if wants_prefix else PAGED
    preferred = [w for w in capable if w.engine_kind == kind]
    return (preferred, kind) if preferred else (capable, None)


def _pick_variant(
    req: RouteRequest, candidates: list[WorkerView], config: RoutingConfig
) -> tuple[str, list[WorkerView]]:
    """The canary arm and its capable candidates (step 3)."""
    if not config.variants:
        if req.variant_override not in (None, DEFAULT_VARIANT):
            raise UnknownVariant(f"unknown variant {req.variant_override!r}; this model has only 'default'")
        return DEFAULT_VARIANT, candidates

    def members(v: Variant) -> list[WorkerView]:
        return [w for w in candidates if any(p.holds(w) for p in v.pools)]

    if req.variant_override is not None:
        v = next((v for v in config.variants if v.name == req.variant_override), None)
        if v is None:
            names = ", ".join(v.name for v in config.variants)
            raise UnknownVariant(f"unknown variant {req.variant_override!r}; configured: {names}")
        found = members(v)
        if not found:
            raise NoCapableWorker(f"variant {v.name!r} has no healthy worker able to serve this request")
        return v.name, found

    point = sticky_point(_sticky_key(req, config))
    usable = [(v, members(v)) for v in config.variants if v.weight > 0]
    chosen = pick_weighted(point, usable, [v.weight for v, _ in usable])
    if chosen[1]:
        return chosen[0].name, chosen[1]
    # the key's arm cannot serve this request: same point over the arms that can
    usable = [(v, m) for v, m in usable if m]
    if not usable:
        raise NoCapableWorker("no canary variant has a healthy worker able to serve this request")
    v, found = pick_weighted(point, usable, [v.weight for v, _ in usable])
    return v.name, found


def _sticky_key(req: RouteRequest, config: RoutingConfig) -> str:
    first, second = (req.session_key, req.user_key)
    if config.sticky_key == "user":
        first, second = second, first
    if first is not None:
        return first
    if second is not None:
        return second
    # anonymous: spread by prompt head, so identical prompts land in the same arm
    return "prompt:" + ",".join(map(str, req.block_hashes[:4])) + f":{req.num_prompt_tokens}"


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


def _overloaded(w: WorkerView, config: RoutingConfig) -> bool:
    return _load(w, config) >= config.overload_running or w.kv_usage >= config.overload_kv_usage


def _pick_replica(
    pool: list[WorkerView], hashes: tuple[int, ...], config: RoutingConfig, index: WorkerBlockIndex
) -> tuple[WorkerView, str]:
    loads = {w.worker_id: _load(w, config) for w in pool}
    least = min(pool, key=lambda w: (loads[w.worker_id], w.kv_usage, w.worker_id))
    busiest, idlest = max(loads.values()), loads[least.worker_id]
    if busiest - idlest > config.imbalance_abs and busiest > config.imbalance_ratio * idlest:
        return least, "imbalance"
    best, best_score, best_cached, least_cached = least, None, 0, None
    for w in pool:
        cached = index.match(w.worker_id, hashes)
        least_cached = cached if least_cached is None else min(least_cached, cached)
        score = cached - config.load_penalty * loads[w.worker_id]
        if best_score is None or score > best_score or (
            score == best_score and (loads[w.worker_id], w.worker_id) < (loads[best.worker_id], best.worker_id)
        ):
            best, best_score, best_cached = w, score, cached
    # "cache_match" only when the cache told the workers apart (a block every worker holds,
    # like a shared system prompt, does not)
    return best, ("cache_match" if best_cached > least_cached else "least_load")


# the most decisive step names the decision: an operator action first, then hard constraints,
# then what overrode the cache-first choice, then the engine choice, then the replica choice
_PRECEDENCE = (
    "override", "capability", "affinity", "shed", "spill", "imbalance", "round_robin", "multi_turn", "reuse_high", "reuse_low",
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
