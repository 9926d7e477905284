"""Page tables, reference counts and copy-on-write over one KV pool.

Every sequence (one output of one request, or one beam) owns a block table: the list of pages
holding its KV, in position order, and `num_tokens`, how many of its positions have a slot.
Pages come from an engine_core `Allocator` (`engine_core.kv_pool.PageAllocator`, an O(1) free list); this class adds
reference counts so forks share pages:

- `fork(parent, child)` gives the child the parent's table and increments every page's count.
- Full pages are immutable once shared. The partial last page is shared too, but the first
  `append_slots` of a sequence whose last page has count > 1 copies it to a fresh page (the
  returned (src, dst) pair; the caller copies the KV) before writing - copy-on-write.
- `free(seq)` decrements; a page returns to the free list when its count reaches 0.

With a `PrefixCache` (engine_paged.prefix_cache), full pages are also cached:
- `cache_full_blocks(seq, tokens, num_computed, salt)` records every newly computed full page;
- a cached page whose count reaches 0 stays cached (the LRU) instead of going back to the allocator;
- `allocate_cached(seq, tokens, salt)` starts a new table with the longest verified cached prefix
  (at least one token is left to compute, so the step has a row to take logits from);
- when the allocator is empty, the least recently released cached pages are evicted and reused.
Cached pages are full, so copy-on-write (which only ever copies a partial last page) never touches one.

Invariant (`check_integrity`): allocator's free pages + held pages + cached unheld pages == total;
each held page's count equals the number of tables that hold it; every cached page is held or in
the LRU, never both, and the cache's maps agree.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from duet.hashing import chain_hash
from engine_core.kv_pool import Allocator
from engine_paged.prefix_cache import PrefixCache


@dataclass
class BlockTable:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0  # positions that have a slot (written or about to be written this step)
    # prefix cache: chained hash and verified cache id of each full computed page, in order
    hashes: list[int] = field(default_factory=list)
    cache_ids: list[int | None] = field(default_factory=list)


class BlockManager:
    """`watermark` (fraction of all pages) is kept free when admitting NEW sequences, so a
    just-admitted batch leaves room for running sequences to grow instead of thrashing."""

    def __init__(self, allocator: Allocator, page_size: int, watermark: float = 0.01,
                 prefix_cache: PrefixCache | None = None) -> None:
        assert page_size > 0
        assert prefix_cache is None or prefix_cache.page_size == page_size, "cache blocks are pages"
        self.allocator = allocator
        self.page_size = page_size
        self.cache = prefix_cache
        self.watermark_pages = int(watermark * allocator.num_total)
        self.ref_counts: dict[int, int] = {}  # page -> count, pages in use only
        self.tables: dict[Hashable, BlockTable] = {}

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation can take: the allocator's plus cached pages nobody holds (evictable)."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_total_pages(self) -> int:
        return self.allocator.num_total

    @property
    def num_used_pages(self) -> int:
        """Pages held by sequences (cached pages nobody holds are not counted: they are reclaimable)."""
        return len(self.ref_counts)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.tables[seq_id].pages

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.tables[seq_id].num_tokens

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.tables

    def pages_needed(self, seq_id: Hashable, num_new: int) -> int:
        """Fresh pages `append_slots(seq_id, num_new)` would take (including a copy-on-write)."""
        table = self.tables.get(seq_id)
        if table is None:
            return self.pages_for(num_new)
        have = len(table.pages)
        need = self.pages_for(table.num_tokens + num_new) - have
        if num_new > 0 and self._last_page_shared(table):
            need += 1
        return need

    def can_admit(self, num_tokens: int) -> bool:
        """Room for a new sequence of `num_tokens` slots above the watermark."""
        return self.pages_for(num_tokens) + self.watermark_pages <= self.num_free_pages

    def can_admit_pages(self, num_pages: int) -> bool:
        """Room for `num_pages` more pages above the watermark."""
        return num_pages + self.watermark_pages <= self.num_free_pages

    def can_append(self, seq_id: Hashable, num_new: int) -> bool:
        return self.pages_needed(seq_id, num_new) <= self.num_free_pages

    # -- changes ------------------------------------------------------------------------
    def append_slots(self, seq_id: Hashable, num_new: int) -> list[tuple[int, int]]:
        """Give `seq_id` slots for `num_new` more positions (creating its table if new).

        Returns the pages to copy before the model writes, as (src, dst) pairs. The caller
        checked `can_append`; running out here is a bug, not user input.
        """
        table = self.tables.setdefault(seq_id, BlockTable())
        copies: list[tuple[int, int]] = []
        if num_new > 0 and self._last_page_shared(table):
            # copy-on-write: the partial last page is about to receive new slots
            old = table.pages[-1]
            (new,) = self._alloc(1)
            self._decref(old)
            table.pages[-1] = new
            copies.append((old, new))
        grow = self.pages_for(table.num_tokens + num_new) - len(table.pages)
        if grow > 0:
            table.pages.extend(self._alloc(grow))
        table.num_tokens += num_new
        return copies

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares all of the parent's pages (counts +1); writes diverge by CoW."""
        assert child_id not in self.tables, f"sequence {child_id!r} already has a table"
        parent = self.tables[parent_id]
        for page in parent.pages:
            self.ref_counts[page] += 1
        self.tables[child_id] = BlockTable(list(parent.pages), parent.num_tokens, list(parent.hashes),
                                           list(parent.cache_ids))

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's pages (no-op for an unknown id, so abort paths stay simple)."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        # reversed: the tail pages go back first, so the free list hands out warm pages last
        for page in reversed(table.pages):
            self._decref(page)

    # -- prefix cache --------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], salt: str = "") -> list[int]:
        """Pages of the longest verified cached prefix of `token_ids` (not taken; see allocate_cached)."""
        if self.cache is None:
            return []
        max_blocks = (len(token_ids) - 1) // self.page_size  # leave a token to compute
        return [b.page for b in self.cache.match(token_ids, salt, max_blocks)]

    def num_evictable_among(self, pages: list[int]) -> int:
        """How many of `pages` are cached and unheld: taking them uses up free pages."""
        return sum(1 for p in set(pages) if p not in self.ref_counts)

    def allocate_cached(self, seq_id: Hashable, token_ids: list[int], salt: str = "", use_cache: bool = True) -> int:
        """Start `seq_id`'s table with its longest cached prefix (none when not `use_cache`); return the number
        of tokens it covers."""
        assert seq_id not in self.tables, f"sequence {seq_id!r} already has a table"
        table = self.tables[seq_id] = BlockTable()
        if self.cache is None or not use_cache:
            return 0
        hits = self.cache.match(token_ids, salt, (len(token_ids) - 1) // self.page_size)
        for b in hits:
            self.cache.hit(b.page)
            if b.page in self.ref_counts:
                self.ref_counts[b.page] += 1
            else:
                self.cache.touch(b.page)
                self.ref_counts[b.page] = 1
        table.pages = [b.page for b in hits]
        table.hashes = [b.block_hash for b in hits]
        table.cache_ids = [b.cache_id for b in hits]
        table.num_tokens = len(hits) * self.page_size
        return table.num_tokens

    def cache_full_blocks(self, seq_id: Hashable, token_ids: list[int], num_computed: int, salt: str = "") -> None:
        """Cache every full page of `seq_id` whose tokens are all computed now (called after each forward)."""
        table = self.tables.get(seq_id)
        if self.cache is None or table is None:
            return
        size = self.page_size
        run: list[int] = []  # consecutive newly stored blocks: one "stored" event each run
        run_parent = 0
        for j in range(len(table.hashes), num_computed // size):
            parent = table.hashes[j - 1] if j else self.cache.root(salt)
            block = tuple(token_ids[j * size:(j + 1) * size])
            h = chain_hash(parent, block)
            parent_id = table.cache_ids[j - 1] if j else None
            cache_id = None
            newly_stored = False
            if j == 0 or parent_id is not None:  # a chain broken by a collision stays uncached from there on
                was_cached = h in self.cache.by_hash
                cache_id = self.cache.store(table.pages[j], h, block, salt, parent_id)
                newly_stored = cache_id is not None and not was_cached
            if newly_stored:
                if not run:
                    run_parent = table.hashes[j - 1] if j else 0
                run.append(h)
            elif run:
                self.cache.stored(run, run_parent)
                run = []
            table.hashes.append(h)
            table.cache_ids.append(cache_id)
        self.cache.stored(run, run_parent)

    def take_kv_events(self) -> list:
        return self.cache.take_events() if self.cache else []

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken (tests call this after every op)."""
        counts: dict[int, int] = {}
        for seq_id, table in self.tables.items():
            assert len(table.pages) == self.pages_for(table.num_tokens), (
                f"{seq_id!r}: {len(table.pages)} pages for {table.num_tokens} tokens"
            )
            assert len(set(table.pages)) == len(table.pages), f"{seq_id!r}: page listed twice"
            for page in table.pages:
                counts[page] = counts.get(page, 0) + 1
            assert len(table.hashes) == len(table.cache_ids) <= table.num_tokens // self.page_size, (
                f"{seq_id!r}: hashes for pages that are not full")
        assert counts == self.ref_counts, "reference counts differ from the tables"
        assert all(c > 0 for c in self.ref_counts.values())
        assert self.num_free_pages + len(self.ref_counts) == self.num_total_pages, (
            f"free {self.allocator.num_free} + cached unheld {self.num_free_pages - self.allocator.num_free} "
            f"+ held {len(self.ref_counts)} != total {self.num_total_pages}"
        )
        if self.cache is not None:
            self.cache.check_integrity(set(self.ref_counts))

    # -- internals ----------------------------------------------------------------------
    def _last_page_shared(self, table: BlockTable) -> bool:
        partial = table.num_tokens % self.page_size != 0
        return partial and self.ref_counts[table.pages[-1]] > 1

    def _alloc(self, n: int) -> list[int]:
        fresh = min(n, self.allocator.num_free)
        pages = self.allocator.alloc(fresh)
        if fresh < n:  # the cache gives up its least recently used pages
            assert self.cache is not None, "caller checked can_append"
            pages += self.cache.evict(n - fresh)
        for page in pages:
            assert page not in self.ref_counts, f"allocator handed out page {page} twice"
            self.ref_counts[page] = 1
        return pages

    def _decref(self, page: int) -> None:
        count = self.ref_counts[page] - 1
        if count:
            self.ref_counts[page] = count
        else:
            del self.ref_counts[page]
            if self.cache is not None and self.cache.is_cached(page):
                self.cache.release(page)
            else:
                self.allocator.free([page])
