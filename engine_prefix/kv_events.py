"""KV events: which prompt blocks the radix cache stored and evicted, as the gateway hashes them.

Blocks are ``block_size`` tokens (reported in GetInfo as ``hash_block_size``), hashed with
``duet.hashing`` from ``H(model_id || cache_salt)`` exactly as the gateway hashes a prompt head, so a
STORED hash here equals the gateway's hash of the same prompt block of the same tenant.

A block is cached when every one of its tokens is: a tree node covering tokens [s, e) of its path makes
blocks j with s < (j+1)*B <= e newly complete when it is stored, and takes exactly those with it when it is
evicted (leaves go first, so the blocks before it stay). Splitting a node changes nothing cached and emits
nothing. ``reset`` emits CLEARED. Block and page sizes need not match.
"""

from __future__ import annotations

from duet.hashing import block_hashes
from engine_core.request import KvEvent
from engine_prefix.radix_cache import Node, RadixCache


class KvEventRecorder:
    """A RadixCache listener that buffers events until ``take()``; ``max_pending`` bounds the buffer when
    nobody reads (older events are dropped; the KvEventBatch sequence lets readers notice gaps)."""

    def __init__(self, model_id: str, block_size: int, max_pending: int = 10_000) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model_id = model_id
        self.block_size = block_size
        self.max_pending = max_pending
        self._events: list[KvEvent] = []

    def take(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def _push(self, event: KvEvent) -> None:
        self._events.append(event)
        if len(self._events) > self.max_pending:
            del self._events[: len(self._events) - self.max_pending]

    def _blocks(self, cache: RadixCache, node: Node) -> tuple[list[int], int]:
        """(hashes of the blocks this node completes, hash of the block before them or 0)."""
        path = cache.path_tokens(node)
        end = len(path)
        start = end - len(node.key)
        first = start // self.block_size  # first block with (j+1)*B > start
        last = end // self.block_size  # blocks j < last have (j+1)*B <= end
        if first >= last:
            return [], 0
        hashes = block_hashes(path[: last * self.block_size], self.block_size, self.model_id, node.salt)
        parent = hashes[first - 1] if first > 0 else 0
        return hashes[first:last], parent

    def on_stored(self, cache: RadixCache, node: Node) -> None:
        hashes, parent = self._blocks(cache, node)
        if hashes:
            self._push(KvEvent("stored", tuple(hashes), parent))

    def on_evicted(self, cache: RadixCache, node: Node) -> None:
        hashes, _ = self._blocks(cache, node)
        if hashes:
            self._push(KvEvent("evicted", tuple(hashes)))

    def on_cleared(self, cache: RadixCache) -> None:
        self._events.clear()
        self._push(KvEvent("cleared"))
