"""Page tables, reference counts and copy-on-write over one KV pool.

Every sequence (one output of one request, or one beam) owns a block table: the list of pages
holding its KV, in position order, and `num_tokens`, how many of its positions have a slot.
Pages come from `engine_core.kv_pool.PageAllocator` (an O(1) free list); this class adds
reference counts so forks share pages:

- `fork(parent, child)` gives the child the parent's table and increments every page's count.
- Full pages are immutable once shared. The partial last page is shared too, but the first
  `append_slots` of a sequence whose last page has count > 1 copies it to a fresh page (the
  returned (src, dst) pair; the caller copies the KV) before writing - copy-on-write.
- `free(seq)` decrements; a page returns to the free list when its count reaches 0.

Invariant (`check_integrity`): free pages + pages in use == total, and each in-use page's
count equals the number of tables that hold it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol


class PageAllocatorLike(Protocol):
    num_free: int
    num_total: int

    def alloc(self, n: int) -> list[int]: ...

    def free(self, pages: list[int]) -> None: ...


@dataclass
class BlockTable:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0  # positions that have a slot (written or about to be written this step)


class BlockManager:
    """`watermark` (fraction of all pages) is kept free when admitting NEW sequences, so a
    just-admitted batch leaves room for running sequences to grow instead of thrashing."""

    def __init__(self, allocator: PageAllocatorLike, page_size: int, watermark: float = 0.01) -> None:
        assert page_size > 0
        self.allocator = allocator
        self.page_size = page_size
        self.watermark_pages = int(watermark * allocator.num_total)
        self.ref_counts: dict[int, int] = {}  # page -> count, pages in use only
        self.tables: dict[Hashable, BlockTable] = {}

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_total_pages(self) -> int:
        return self.allocator.num_total

    @property
    def num_used_pages(self) -> int:
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
        self.tables[child_id] = BlockTable(list(parent.pages), parent.num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's pages (no-op for an unknown id, so abort paths stay simple)."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        # reversed: the tail pages go back first, so the free list hands out warm pages last
        for page in reversed(table.pages):
            self._decref(page)

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
        assert counts == self.ref_counts, "reference counts differ from the tables"
        assert all(c > 0 for c in self.ref_counts.values())
        assert self.num_free_pages + len(self.ref_counts) == self.num_total_pages, (
            f"free {self.num_free_pages} + used {len(self.ref_counts)} != total {self.num_total_pages}"
        )

    # -- internals ----------------------------------------------------------------------
    def _last_page_shared(self, table: BlockTable) -> bool:
        partial = table.num_tokens % self.page_size != 0
        return partial and self.ref_counts[table.pages[-1]] > 1

    def _alloc(self, n: int) -> list[int]:
        pages = self.allocator.alloc(n)
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
            self.allocator.free([page])
