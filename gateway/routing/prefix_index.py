"""The two bounded-memory tables behind prefix-aware routing.

Both hold chained block hashes (duet/hashing.py): block i's hash covers every token before
it, so "block i is known" implies "blocks 0..i are the same prompt". Lookups therefore walk
a prompt's hashes from the head and stop at the first miss; a lookup costs one dict hit per
matched block plus one.

- `SeenBlocks`: head blocks seen recently on any worker. `leading_seen(hashes)` is the
  numerator of the estimated reuse that picks the engine kind.
- `WorkerBlockIndex`: per worker, the blocks believed cached there. Fed optimistically by
  routing decisions (the worker will cache what it is sent) and corrected by the worker's
  KV events (stored / evicted / cleared). `match(worker, hashes)` is the replica score.

Both are LRU-bounded. A prompt's blocks are inserted deepest first so its head ends up the
most recently used: eviction then removes the tails of old prompts before their heads,
which keeps each table close to prefix-closed (the early-stop walk stays exact), the way a
radix cache evicts leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

KV_EVENT_KINDS = ("stored", "evicted", "cleared")


class _LruBlocks:
    """An LRU set of block hashes with a fixed capacity."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"block table capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def leading(self, hashes: Sequence[int]) -> int:
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break  # chained hashes: nothing deeper can match
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        # deepest first, so the head is the most recently used (evicted last)
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def discard(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._blocks.pop(h, None)

    def clear(self) -> None:
        self._blocks.clear()


class SeenBlocks:
    """Head blocks seen recently, whatever worker served them (bounded LRU)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._lru = _LruBlocks(capacity)

    @property
    def capacity(self) -> int:
        return self._lru.capacity

    def __len__(self) -> int:
        return len(self._lru)

    def leading_seen(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` were seen before (stops at the first miss)."""
        return self._lru.leading(hashes)

    def estimated_reuse(self, hashes: Sequence[int]) -> float:
        """Leading seen blocks over total head blocks; 0.0 for a prompt shorter than a block."""
        return self._lru.leading(hashes) / len(hashes) if hashes else 0.0

    def add(self, hashes: Sequence[int]) -> None:
        self._lru.add(hashes)


class WorkerBlockIndex:
    """Per-worker LRU table of the blocks believed cached on each worker.

    Memory is bounded: at most `capacity_per_worker` hashes per worker (set it near the
    worker's KV capacity in blocks; more would only remember blocks the worker evicted)."""

    def __init__(self, capacity_per_worker: int = 65_536) -> None:
        if capacity_per_worker < 1:
            raise ValueError(f"capacity_per_worker must be >= 1, got {capacity_per_worker}")
        self.capacity_per_worker = capacity_per_worker
        self._workers: dict[str, _LruBlocks] = {}

    def _table(self, worker_id: str) -> _LruBlocks:
        table = self._workers.get(worker_id)
        if table is None:
            table = self._workers[worker_id] = _LruBlocks(self.capacity_per_worker)
        return table

    def workers(self) -> list[str]:
        return list(self._workers)

    def num_blocks(self, worker_id: str) -> int:
        table = self._workers.get(worker_id)
        return len(table) if table is not None else 0

    def match(self, worker_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` believed cached on `worker_id`."""
        table = self._workers.get(worker_id)
        return table.leading(hashes) if table is not None else 0

    def add(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Record that `worker_id` was sent (and will cache) these blocks."""
        self._table(worker_id).add(hashes)

    def apply_kv_event(self, worker_id: str, kind: str, hashes: Sequence[int] = ()) -> None:
        """Correct the table from a worker's KV event: "stored" adds the blocks, "evicted"
        removes them, "cleared" forgets everything cached on that worker."""
        if kind == "stored":
            self._table(worker_id).add(hashes)
        elif kind == "evicted":
            table = self._workers.get(worker_id)
            if table is not None:
                table.discard(hashes)
        elif kind == "cleared":
            table = self._workers.get(worker_id)
            if table is not None:
                table.clear()
        else:
            raise ValueError(f"unknown KV event kind {kind!r}; expected one of {KV_EVENT_KINDS}")

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (gone or restarted: its cache is gone too)."""
        self._workers.pop(worker_id, None)
