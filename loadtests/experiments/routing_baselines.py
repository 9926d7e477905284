"""The routing policies Duet is compared with in `duet bench simulate-routing`.

Each policy has `choose(rec, workers) -> index` and `observe(index, rec, evicted, workers)`;
`workers` are the simulator's workers (`.load` = requests in flight). They see only what a
router in front of the workers would see.

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
  sglang-router command line's: 0.3, 64, 1.5, and 2^26 tokens of tree.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict

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


class SGLangCacheAware(RoundRobin):
    name = "sglang_cache_aware"

    def __init__(self, num_workers: int, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 1 << 26) -> None:
        super().__init__(num_workers)
        self.cache_threshold = cache_threshold
        self.abs = balance_abs_threshold
        self.rel = balance_rel_threshold
        self.max_blocks = max(1, max_tree_tokens // MOONCAKE_BLOCK_TOKENS)
        # chained block ids: a set per worker is exactly a radix tree over blocks
        self.trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_workers)]

    def choose(self, rec: TraceRecord, workers) -> int:
        loads = [w.load for w in workers]
        if max(loads) - min(loads) > self.abs and max(loads) > self.rel * min(loads):
            return min(range(self.n), key=lambda i: loads[i])
        best, best_len = 0, -1
        for i, tree in enumerate(self.trees):
            n = 0
            for h in rec.hash_ids:
                if h not in tree:
                    break
                n += 1
            if n > best_len:
                best, best_len = i, n
        rate = min(1.0, best_len * MOONCAKE_BLOCK_TOKENS / rec.input_length)
        if rate > self.cache_threshold:
            return best
        return min(range(self.n), key=lambda i: len(self.trees[i]))

    def observe(self, worker: int, rec: TraceRecord, evicted, workers) -> None:
        tree = self.trees[worker]
        for h in rec.hash_ids:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
        while len(tree) > self.max_blocks:
            tree.popitem(last=False)
