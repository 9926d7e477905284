"""The peer routers' policies in the fleet simulator (issue 45, item 4): each written from the peer's own code, at
its defaults, so that Duet's routing is measured against what a team would install, not a strawman.

Each is a callable with the signature of gateway.routing.policy.route (the gateway's `Router` calls it), seeing
only what that router sees: the worker views (`load` = requests in flight, `num_waiting`, `kv_usage`), the prompt's
chained block hashes (duet.hashing, 16 tokens a block) and, for vllm-router, the workers' KV events (`kv_event`,
called by the simulator as the engines emit them). None looks at session affinity, engine kind or Duet's own
prefix tables. Ties are broken as the peer's code breaks them.

- `smg_cache_aware`: SMG's (lightseekorg/smg) src/policies/cache_aware.rs, `CacheAwarePolicy::select_worker`
  and `select_worker_with_text`. Imbalanced workers ((max - min load) > balance_abs_threshold 64 and max > 1.5 x
  min) -> the least loaded. Else the longest prefix match in one approximate radix tree over what was sent to
  each worker (never told about evictions; the tenant of the deepest matched node); its match rate (matched /
  prompt characters) > cache_threshold 0.3 -> that worker, else the least loaded (sglang-router's version took
  the smallest tree here: loadtests/sim/routing/baselines.py). Either way the prompt joins the chosen worker's
  tree. max_tree_size 2^26 characters a tenant: never reached in these runs, so eviction is not modelled.
  The tree holds the WHOLE prompt (SMG matches the full text), so the policy asks for uncapped hashes.
- `vllm_kv_aware`: vllm-router's (vllm-project/router) src/policies/kv_aware.rs, `KvAwarePolicy::
  select_with_scoring`. An index of each worker's cached blocks from its KV events (stored / removed), plus
  speculative entries: after each choice the blocks the chosen worker lacked are entered for it for
  speculative_ttl 2 s (until its real events arrive). Score = the longest contiguous prefix of the prompt's
  blocks a worker holds (`PrefixScorer`); the highest score wins (Rust's `max_by_key`: the LAST of equal
  maxima); a best score of 0 -> the least loaded (`min_by_key`: the first of equals). No load term otherwise.
  The whole prompt is hashed (it tokenizes the full text). `vllm_kv_aware_unmatched`: the same with an index
  that never matches the request's blocks (a tokenizer, model name or block size that differs from the
  engines'): every choice is then the least-loaded fallback, first of equals. It is what the real router did
  on this machine (loadtests/sim/fleet/peer_check.py), shown beside the policy as its code means it.
- `llmd_default`: llm-d's default scheduling profile (the InferencePool chart's default-plugins.yaml, as in
  llm-d-inference-scheduler's deploy configs): queue-scorer weight 2, kv-cache-utilization-scorer weight 2,
  prefix-cache-scorer weight 3, max-score-picker. queue: (max - own waiting) / (max - min waiting) over the
  candidates, 1.0 for all when equal; kv utilization: 1 - KV usage; prefix (the approximate one): leading
  matched blocks / the prompt's blocks (at most maxPrefixBlocksToMatch 256), against a per-server LRU of
  lruCapacityPerServer 31250 blocks filled with what was routed there (never told about evictions). The
  picker takes the highest weighted sum, ties at random (seeded here: deterministic). The plugin hashes
  hashBlockSize 64 by default; here the simulator's 16-token blocks (the engines' own).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gateway.routing.policy import eligible
from gateway.routing.route_types import RouteDecision, RouteRequest, RoutingConfig, WorkerView

PEER_POLICIES = ("smg_cache_aware", "vllm_kv_aware", "llmd_default")
VARIANTS = ("vllm_kv_aware_unmatched",)  # a peer as it was seen to run, not as its code means it (module doc)


def _decision(req: RouteRequest, w: WorkerView, variant: str, steps: list[str], reason: str, seen,
              index) -> RouteDecision:
    # an operator's override, then a capability, names the decision, as in Duet's policy
    decisive = next((s for s in ("override", "capability") if s in steps), reason)
    return RouteDecision(worker_id=w.worker_id, engine_kind=w.engine_kind, variant=variant, reason=decisive,
                         estimated_reuse=seen.estimated_reuse(req.block_hashes),
                         cached_blocks=index.match(w.worker_id, req.block_hashes), steps=(*steps, reason))


def _least_loaded(pool: Sequence[WorkerView]) -> int:
    """The first of the least loaded (Rust's min_by_key)."""
    return min(range(len(pool)), key=lambda i: pool[i].load)


class SmgCacheAware:
    """SMG's cache_aware (module doc). The tree: block hash -> {worker: last touch}; a chained hash held by a
    worker means the whole prefix up to it was sent there, so a walk down the hashes is a walk down the tree."""

    name = "smg_cache_aware"
    full_prompt = True  # match the whole prompt, not the gateway's 256-block head

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.abs, self.rel = balance_abs_threshold, balance_rel_threshold
        self.tree: dict[int, dict[str, int]] = {}
        self.touch = 0

    def match(self, hashes: Sequence[int], alive: set[str]) -> tuple[int, str | None]:
        """(matched blocks, the tenant of the deepest matched node: its most recent toucher) over `alive`."""
        matched, last = 0, None
        for h in hashes:
            holders = self.tree.get(h)
            if not holders or not any(w in alive for w in holders):
                break
            matched, last = matched + 1, holders
        if last is None:
            return 0, None
        return matched, max((w for w in last if w in alive), key=last.get)

    def insert(self, worker_id: str, hashes: Sequence[int]) -> None:
        self.touch += 1
        for h in hashes:
            self.tree.setdefault(h, {})[worker_id] = self.touch

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig,
                 affinity_worker, seen, index) -> RouteDecision:
        variant, pool, steps = eligible(req, workers, config)
        loads = [w.load for w in pool]
        if max(loads) - min(loads) > self.abs and max(loads) > self.rel * min(loads):
            i, reason = _least_loaded(pool), "imbalance"
        else:
            matched, tenant = self.match(req.block_hashes, {w.worker_id for w in pool})
            rate = min(1.0, matched * req.block_tokens / max(1, req.num_prompt_tokens))
            if rate > self.cache_threshold and tenant is not None:
                i, reason = next(j for j, w in enumerate(pool) if w.worker_id == tenant), "cache_match"
            else:
                i, reason = _least_loaded(pool), "least_load"
        self.insert(pool[i].worker_id, req.block_hashes)
        return _decision(req, pool[i], variant, steps, reason, seen, index)


class VllmKvAware:
    """vllm-router's kv_aware (module doc): a KV-event index with speculative entries, longest prefix wins."""

    name = "vllm_kv_aware"
    full_prompt = True

    def __init__(self, clock: Callable[[], float], speculative_ttl_s: float = 2.0, matching: bool = True) -> None:
        self.clock = clock
        self.matching = matching
        self.ttl = speculative_ttl_s
        self.cached: dict[str, set[int]] = {}  # from the engines' KV events
        self.speculative: dict[str, dict[int, float]] = {}  # worker -> hash -> expiry

    def kv_event(self, worker_id: str, kind: str, hashes: Sequence[int]) -> None:
        blocks = self.cached.setdefault(worker_id, set())
        if kind == "stored":
            blocks.update(hashes)
        elif kind == "evicted":
            blocks.difference_update(hashes)
        elif kind == "cleared":
            blocks.clear()

    def score(self, worker_id: str, hashes: Sequence[int], now: float) -> int:
        """Leading blocks held: cached, or speculatively entered and not expired."""
        real = self.cached.get(worker_id, ())
        guess = self.speculative.get(worker_id, {})
        n = 0
        for h in hashes:
            if h not in real and guess.get(h, -1.0) <= now:
                break
            n += 1
        return n

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig,
                 affinity_worker, seen, index) -> RouteDecision:
        variant, pool, steps = eligible(req, workers, config)
        hashes = req.block_hashes
        if len(pool) == 1:
            return _decision(req, pool[0], variant, steps, "single", seen, index)
        if not hashes or not self.matching:  # shorter than one block (or, unmatched, every request's keys miss)
            return _decision(req, pool[_least_loaded(pool)], variant, steps, "least_load", seen, index)
        now = self.clock()
        scores = [self.score(w.worker_id, hashes, now) for w in pool]
        best = max(scores)
        if best == 0:
            i, reason = _least_loaded(pool), "least_load"
        else:
            i, reason = max(j for j, s in enumerate(scores) if s == best), "cache_match"  # the last of equals
        if best < len(hashes):
            guess = self.speculative.setdefault(pool[i].worker_id, {})
            if len(guess) > 4 * len(hashes) + 4096:  # drop the expired now and then (memory only)
                for h in [h for h, t in guess.items() if t <= now]:
                    del guess[h]
            for h in hashes[best:]:
                guess[h] = now + self.ttl
        return _decision(req, pool[i], variant, steps, reason, seen, index)


class LlmdDefault:
    """llm-d's default scorers and weights (module doc), with the approximate prefix-cache scorer."""

    name = "llmd_default"
    full_prompt = False  # the prefix scorer matches at most 256 blocks: the gateway's head

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0, prefix_weight: float = 3.0,
                 lru_blocks_per_server: int = 31250, max_prefix_blocks: int = 256, seed: int = 0) -> None:
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self.capacity, self.max_blocks = lru_blocks_per_server, max_prefix_blocks
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.rng = random.Random(seed)

    def prefix_score(self, worker_id: str, hashes: Sequence[int]) -> float:
        if not hashes:
            return 0.0
        table = self.lru.get(worker_id, {})
        n = 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n / len(hashes)

    def scores(self, pool: Sequence[WorkerView], hashes: Sequence[int]) -> list[float]:
        """Each candidate's weighted sum of the three scorers."""
        wq, wk, wp = self.weights
        waiting = [w.num_waiting for w in pool]
        lo, hi = min(waiting), max(waiting)
        out = []
        for w in pool:
            queue = 1.0 if hi == lo else (hi - w.num_waiting) / (hi - lo)
            kv = 1.0 - w.kv_usage
            out.append(wq * queue + wk * kv + wp * self.prefix_score(w.worker_id, hashes))
        return out

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig,
                 affinity_worker, seen, index) -> RouteDecision:
        variant, pool, steps = eligible(req, workers, config)
        hashes = req.block_hashes[: self.max_blocks]
        scores = self.scores(pool, hashes)
        best = max(scores)
        tied = [j for j, s in enumerate(scores) if s == best]
        i = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        # PreRequest: the prompt's blocks join the chosen server's LRU
        table = self.lru.setdefault(pool[i].worker_id, OrderedDict())
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.capacity:
            table.popitem(last=False)
        return _decision(req, pool[i], variant, steps, "max_score", seen, index)


def make_peer_policy(name: str, clock: Callable[[], float]):
    """One peer policy (a fresh state) for one simulated fleet."""
    if name == "smg_cache_aware":
        return SmgCacheAware()
    if name == "vllm_kv_aware":
        return VllmKvAware(clock)
    if name == "vllm_kv_aware_unmatched":
        return VllmKvAware(clock, matching=False)
    if name == "llmd_default":
        return LlmdDefault()
    raise ValueError(f"unknown peer policy {name!r}; choose from {', '.join(PEER_POLICIES + VARIANTS)}")
