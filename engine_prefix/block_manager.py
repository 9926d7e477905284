"""Each running request's page table over the radix cache and an engine_core `Allocator` (engine_paged's
BlockManager is the other kind's).

Page ownership: a running request's page table is ``seq.pages``; ``pages[:num_tree_pages]`` belong to the
radix tree and are held by a lock on ``seq.node``; the rest are private to the request.
- `alloc_until` grows a table, evicting unlocked cached pages when the allocator runs short.
- `cache_prefix` inserts the computed whole pages into the tree and moves the lock down to their end. It runs
  whenever a prefill chunk ends, so a later request with the same prefix hits it at once, even mid-prefill.
- `release` gives every page up: the computed whole pages to the tree (when asked: a finished or preempted
  request), the private rest to the allocator, and the lock.

Invariant (`check_integrity`): free + evictable + protected + private == total, every page owned once.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.kv_pool import Allocator
from engine_prefix.radix_cache import RadixCache
from engine_prefix.sequence import Seq


class BlockManager:
    def __init__(self, allocator: Allocator, cache: RadixCache) -> None:
        assert cache.allocator is allocator, "the cache frees its evicted pages to the same allocator"
        self.allocator = allocator
        self.cache = cache
        self.page_size = cache.page_size

    @property
    def num_total_pages(self) -> int:
        return self.allocator.num_total

    @property
    def num_available_pages(self) -> int:
        """Pages a new allocation can take: the allocator's plus cached pages nobody holds (evictable)."""
        return self.allocator.num_free + self.cache.evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc_until(self, seq: Seq, num_tokens: int) -> bool:
        """Grow ``seq.pages`` to hold ``num_tokens`` tokens, evicting cached pages if needed; False (nothing
        taken) when even eviction leaves too few."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        if self.allocator.num_free < need:
            return False
        seq.pages.extend(self.allocator.alloc(need))
        return True

    def cache_prefix(self, seq: Seq) -> None:
        """Insert the computed whole pages into the tree and move the lock to their end."""
        n_pages = seq.num_computed // self.page_size
        if n_pages <= seq.num_tree_pages:
            return
        length = n_pages * self.page_size
        res = self.cache.insert(seq.tokens[:length], seq.pages[:n_pages], seq.req.cache_salt)
        self.allocator.free(res.duplicate_pages)
        match = self.cache.match_prefix(seq.tokens[:length], seq.req.cache_salt)
        assert match.length == length
        seq.pages[:n_pages] = match.pages  # duplicates replaced by the tree's identical pages
        self.cache.lock(match.node)
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.node, seq.num_tree_pages = match.node, n_pages

    def release(self, seq: Seq, cache: bool) -> None:
        """Give up every page: cache the computed whole pages (if ``cache``), free the private rest."""
        if cache:
            self.cache_prefix(seq)
        self.allocator.free(seq.pages[seq.num_tree_pages :])
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = [], None, 0, 0

    @staticmethod
    def private_pages(running: Iterable[Seq]) -> list[int]:
        return [p for s in running for p in s.pages[s.num_tree_pages :]]

    def check_integrity(self, running: Iterable[Seq]) -> None:
        """Raise AssertionError unless the pages of the tree, the allocator and the running requests add up."""
        self.cache.check_integrity(self.private_pages(running))
