"""Automatic prefix caching for the paged engine, as vLLM does it: full pages are remembered by the
chained hash of the tokens up to and including them (`duet.hashing`, the gateway's hash, with the
request's cache salt), and a page nobody holds any more stays cached in a free-block LRU until its
memory is needed.

    page states:  free (allocator) | held (ref count > 0, maybe cached) | cached & unheld (the LRU)
    a cached page is always FULL and never written again (only the partial last page is ever written)

Lookups never trust a hash alone: every cached block records its tokens, its salt and the `cache_id`
of the block before it (ids are never reused), and `match` walks from the first block checking all
three, so a hit proves the whole prefix is token-for-token the same. A hash collision only means a miss.

KV events (`take_events`) say which block hashes were stored and evicted, in the same form as
engine_prefix's, so the gateway's per-worker block index is exact for paged workers too (the hash
block size is the page size; GetInfo reports it as hash_block_size).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from duet.hashing import chain_hash, root_hash
from engine_core.request import KvEvent


@dataclass(frozen=True)
class CachedBlock:
    page: int
    block_hash: int
    tokens: tuple[int, ...]
    salt: str
    parent_id: int | None  # cache_id of the block before it (None: the first block of a prompt)
    cache_id: int


class PrefixCache:
    def __init__(self, model_id: str, page_size: int, max_pending_events: int = 10_000) -> None:
        self.model_id = model_id
        self.page_size = page_size
        self.max_pending_events = max_pending_events
        self.by_hash: dict[int, CachedBlock] = {}
        self.by_page: dict[int, CachedBlock] = {}
        self.unheld: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self.reused: set[int] = set()  # cached pages some request hit after they were stored
        self.reused_pages_evicted = 0  # evicted pages that were in `reused` (LoadStats reports it)
        self._ids = itertools.count()
        self._events: list[KvEvent] = []

    @property
    def num_evictable(self) -> int:
        return len(self.unheld)

    def root(self, salt: str) -> int:
        return root_hash(self.model_id, salt)

    def match(self, tokens: Sequence[int], salt: str, max_blocks: int) -> list[CachedBlock]:
        """The cached blocks that hold tokens[:k * page_size] for the largest k <= max_blocks (verified)."""
        found: list[CachedBlock] = []
        parent_hash, parent_id = self.root(salt), None
        size = self.page_size
        for j in range(max_blocks):
            block = tuple(tokens[j * size:(j + 1) * size])
            h = chain_hash(parent_hash, block)
            entry = self.by_hash.get(h)
            if entry is None or entry.tokens != block or entry.salt != salt or entry.parent_id != parent_id:
                break
            found.append(entry)
            parent_hash, parent_id = h, entry.cache_id
        return found

    def store(self, page: int, block_hash: int, tokens: tuple[int, ...], salt: str,
              parent_id: int | None) -> int | None:
        """Cache `page` as this block; return the cache_id that now stands for this exact content, or None
        when another block holds the hash (a collision: this content stays uncached)."""
        existing = self.by_hash.get(block_hash)
        if existing is not None:
            same = existing.tokens == tokens and existing.salt == salt and existing.parent_id == parent_id
            return existing.cache_id if same else None  # same content: a duplicate page, left private
        entry = CachedBlock(page, block_hash, tokens, salt, parent_id, next(self._ids))
        self.by_hash[block_hash] = entry
        self.by_page[page] = entry
        return entry.cache_id

    def is_cached(self, page: int) -> bool:
        return page in self.by_page

    def release(self, page: int) -> None:
        """A cached page lost its last holder: keep it, most recently used last."""
        self.unheld[page] = None

    def touch(self, page: int) -> None:
        """A cached page is held again (a hit): it is no longer evictable."""
        self.unheld.pop(page, None)

    def hit(self, page: int) -> None:
        """A request's prompt matched this cached page."""
        self.reused.add(page)

    def evict(self, n: int) -> list[int]:
        """Forget the `n` least recently released cached pages and hand them over for reuse."""
        pages = []
        hashes = []
        for _ in range(n):
            page, _ = self.unheld.popitem(last=False)
            entry = self.by_page.pop(page)
            del self.by_hash[entry.block_hash]
            if page in self.reused:
                self.reused.discard(page)
                self.reused_pages_evicted += 1
            pages.append(page)
            hashes.append(entry.block_hash)
        if hashes:
            self._push(KvEvent("evicted", tuple(hashes)))
        return pages

    def stored(self, hashes: list[int], parent_hash: int) -> None:
        """Record that consecutive blocks `hashes` (after `parent_hash`, 0 at the root) were cached."""
        if hashes:
            self._push(KvEvent("stored", tuple(hashes), parent_hash))

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def _push(self, event: KvEvent) -> None:
        self._events.append(event)
        if len(self._events) > self.max_pending_events:  # nobody reads: drop the oldest (sequence gaps show it)
            del self._events[: len(self._events) - self.max_pending_events]

    def check_integrity(self, held_pages: set[int]) -> None:
        assert len(self.by_hash) == len(self.by_page), "hash and page maps differ in size"
        for page, entry in self.by_page.items():
            assert entry.page == page and self.by_hash.get(entry.block_hash) is entry, f"page {page}: maps disagree"
            assert len(entry.tokens) == self.page_size, f"page {page}: a cached block must be full"
            assert (page in held_pages) != (page in self.unheld), (
                f"cached page {page} must be either held or in the LRU, not {'both' if page in held_pages else 'neither'}")
        for page in self.unheld:
            assert page in self.by_page, f"LRU page {page} is not cached"
        assert self.reused <= self.by_page.keys(), "a reused page is not cached"
