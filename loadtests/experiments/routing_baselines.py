"""The routing policies Duet is compared with: in `duet bench simulate-routing`, and (the SGLang one)
behind a real gateway in `duet bench compare` and `duet bench advise`.

In the simulator each policy has `choose(rec, workers) -> index` and `observe(index, rec, evicted,
workers)`; `workers` are the simulator's workers (`.load` = requests in flight). They see only what
a router in front of the workers would see.

- round_robin: the next worker in turn.
- least_load: the worker with the fewest requests in flight.
- consistent_hash: a hash ring (virtual nodes) over the session key; requests without one
  hash their first block.
- sglang_cache_aware: the SGLang router's cache-aware policy, reimplemented from its
  description: per worker an approximate radix tree of what was sent there (here over trace
  blocks, bounded by max_tree_size, never told about evictions); if the workers are
  imbalanced ((max - min load) > balance_abs_threshold and max > balance_rel_threshold * min)
  take the least loaded; else the longest match if its match rate (matched / prompt tokens)
  exceeds cache_threshold, else the worker with the smallest tree. Defaults are the
  sglang-router command line's: 0.3, 64, 1.5, and 2^26 tokens of tree. One implementation,
  `CacheAwareTrees`, serves both the simulator (`SGLangCacheAware`) and the gateway
  (`sglang_cache_aware_route`: the gateway config's `routing_policy`, gateway/config.py), so
  `compare`, `advise` and `simulate-routing` measure Duet against the same baseline.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from gateway.routing.policy import eligible
from gateway.routing.route_types import RouteDecision, RouteRequest, RoutingConfig, WorkerView
from loadtests.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRecord, session_key

POLICY_NAMES = ("round_robin", "least_load", "consistent_hash", "sglang_cache_aware", "duet")


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class RoundRobin:
    name = "round_robin"

    def __init__(self, num_workers: int) -> None:
        self.n = num_workers
        self.next = 0

    def choose(self, rec: TraceRecord, workers) -> int:
        i = self.next
        self.next = (i + 1) % self.n
        return i

    def observe(self, worker, rec, evicted, workers) -> None:
        pass


class LeastLoad(RoundRobin):
    name = "least_load"

    def choose(self, rec: TraceRecord, workers) -> int:
        # ties rotate, so an idle fleet is not all sent to worker 0
        start = self.next
        self.next = (start + 1) % self.n
        return min(range(self.n), key=lambda i: (workers[i].load, (i - start) % self.n))


class ConsistentHash(RoundRobin):
    name = "consistent_hash"
    VNODES = 160

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        ring = sorted((_h64(f"w{i}#{v}"), i) for i in range(num_workers) for v in range(self.VNODES))
        self.points = [p for p, _ in ring]
        self.owners = [w for _, w in ring]

    def choose(self, rec: TraceRecord, workers) -> int:
        key = session_key(rec) or f"block-{rec.hash_ids[0]}"
        j = bisect.bisect(self.points, _h64(key)) % len(self.points)
        return self.owners[j]


# the gateway adapter's route reasons (a metric label, like gateway.routing.route_types.REASONS)
SGLANG_REASONS = ("imbalance", "cache_match", "smallest_tree")


class CacheAwareTrees:
    """The SGLang router's cache-aware choice and its state: per worker an approximate radix tree of the
    prompts sent there (chained block hashes: a set per worker is exactly a radix tree over blocks), LRU
    bounded by `max_tree_tokens`, never told about evictions."""

    def __init__(self, block_tokens: int, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 1 << 26) -> None:
        self.block_tokens = block_tokens
        self.cache_threshold = cache_threshold
        self.abs = balance_abs_threshold
        self.rel = balance_rel_threshold
        self.max_blocks = max(1, max_tree_tokens // block_tokens)
        self.trees: dict[Hashable, OrderedDict[int, None]] = {}

    def choose(self, workers: Sequence[Hashable], loads: Sequence[int], hashes: Sequence[int],
               num_prompt_tokens: int) -> tuple[int, str]:
        """(index into `workers`, reason): the least loaded when the loads are imbalanced; else the longest
        match when its match rate beats `cache_threshold`; else the smallest tree. Ties: the first."""
        n = len(workers)
        if max(loads) - min(loads) > self.abs and max(loads) > self.rel * min(loads):
            return min(range(n), key=lambda i: loads[i]), "imbalance"
        best, best_len = 0, -1
        for i, w in enumerate(workers):
            tree = self.trees.get(w, {})
            matched = 0
            for h in hashes:
                if h not in tree:
                    break
                matched += 1
            if matched > best_len:
                best, best_len = i, matched
        rate = min(1.0, best_len * self.block_tokens / num_prompt_tokens)
        if rate > self.cache_threshold:
            return best, "cache_match"
        return min(range(n), key=lambda i: len(self.trees.get(workers[i], ()))), "smallest_tree"

    def observe(self, worker: Hashable, hashes: Sequence[int]) -> None:
        """The prompt was sent to `worker`: its blocks join that worker's tree as most recent."""
        tree = self.trees.setdefault(worker, OrderedDict())
        for h in hashes:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
        while len(tree) > self.max_blocks:
            tree.popitem(last=False)


class SGLangCacheAware(RoundRobin):
    """CacheAwareTrees over the simulator's workers (keyed by index)."""

    name = "sglang_cache_aware"

    def __init__(self, num_workers: int, **knobs) -> None:
        super().__init__(num_workers)
        self.trees = CacheAwareTrees(MOONCAKE_BLOCK_TOKENS, **knobs)

    def choose(self, rec: TraceRecord, workers) -> int:
        return self.trees.choose(range(self.n), [w.load for w in workers], rec.hash_ids, rec.input_length)[0]

    def observe(self, worker: int, rec: TraceRecord, evicted, workers) -> None:
        self.trees.observe(worker, rec.hash_ids)


class SGLangRoute:
    """CacheAwareTrees behind the gateway, called as gateway.routing.policy.route is. It keeps the gateway's steps
    1-3 (candidates, capability, canary variant: gateway.routing.policy.eligible) and then, as SGLang's router does,
    ignores session affinity, engine kind and the gateway's prefix tables: over every eligible worker (load:
    its requests in flight), the choice of CacheAwareTrees. Trees are in tokens of the gateway's blocks."""

    def __init__(self, **knobs) -> None:
        self.knobs = knobs
        self.trees: CacheAwareTrees | None = None

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView], config: RoutingConfig,
                 affinity_worker, seen, index) -> RouteDecision:
        variant, pool, steps = eligible(req, workers, config)
        if self.trees is None:
            self.trees = CacheAwareTrees(req.block_tokens, **self.knobs)
        i, reason = self.trees.choose([w.worker_id for w in pool], [w.load for w in pool], req.block_hashes,
                                      req.num_prompt_tokens)
        w = pool[i]
        self.trees.observe(w.worker_id, req.block_hashes)
        # an operator's override, then a capability, names the decision, as in Duet's policy
        decisive = next((s for s in ("override", "capability") if s in steps), reason)
        return RouteDecision(worker_id=w.worker_id, engine_kind=w.engine_kind, variant=variant, reason=decisive,
                             estimated_reuse=seen.estimated_reuse(req.block_hashes),
                             cached_blocks=index.match(w.worker_id, req.block_hashes), steps=(*steps, reason))


def sglang_cache_aware_route() -> SGLangRoute:
    """The gateway's `routing_policy` factory: one SGLangRoute (one set of trees) per gateway, at the
    sglang-router command line's defaults."""
    return SGLangRoute()


# the gateway config's `routing_policy` value (this module's import name, wherever the module lives)
SGLANG_ROUTING_POLICY = f"{__name__}:{sglang_cache_aware_route.__name__}"
