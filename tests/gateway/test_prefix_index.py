"""The bounded prefix tables behind routing (gateway/routing/prefix_index.py)."""

from __future__ import annotations

import pytest

from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex


def test_reuse_estimate_counts_leading_seen_blocks_only():
    seen = SeenBlocks(capacity=100)
    seen.add((1, 2, 3, 4))
    assert seen.leading_seen((1, 2, 3, 4, 5, 6, 7, 8)) == 4
    assert seen.estimated_reuse((1, 2, 3, 4, 5, 6, 7, 8)) == 0.5
    # chained hashes: a miss at block i means nothing beyond it matches, even if seen
    assert seen.leading_seen((1, 99, 3, 4)) == 1
    assert seen.estimated_reuse(()) == 0.0


def test_seen_blocks_memory_is_bounded_and_evicts_tails_before_heads():
    seen = SeenBlocks(capacity=10)
    for p in range(50):
        seen.add(tuple(range(p * 100, p * 100 + 6)))
    assert len(seen) == 10
    last = tuple(range(4900, 4906))
    assert seen.leading_seen(last) == 6
    # the previous prompt lost its tail, not its head: its leading blocks still count
    prev = tuple(range(4800, 4806))
    assert seen.leading_seen(prev) == 4


def test_worker_index_is_bounded_per_worker():
    index = WorkerBlockIndex(capacity_per_worker=64)
    for p in range(100):
        index.add("w1", tuple(range(p * 10, p * 10 + 10)))
    index.add("w2", (1, 2, 3))
    assert index.num_blocks("w1") == 64 and index.num_blocks("w2") == 3
    assert index.match("w1", tuple(range(990, 1000))) == 10
    assert index.match("w2", (1, 2, 3, 4)) == 3
    assert index.match("nobody", (1, 2)) == 0


def test_kv_events_correct_the_worker_index():
    index = WorkerBlockIndex()
    index.add("w1", (1, 2, 3, 4))  # routed there
    index.apply_kv_event("w1", "evicted", (3, 4))  # the worker evicted the tail
    assert index.match("w1", (1, 2, 3, 4)) == 2
    index.apply_kv_event("w1", "stored", (1, 2, 3, 4, 5))
    assert index.match("w1", (1, 2, 3, 4, 5, 6)) == 5
    index.apply_kv_event("w2", "stored", (7, 8))  # a worker we never routed to
    assert index.match("w2", (7, 8)) == 2
    index.apply_kv_event("w1", "cleared")
    assert index.match("w1", (1, 2)) == 0
    index.remove_worker("w2")
    assert index.match("w2", (7, 8)) == 0 and "w2" not in index.workers()
    with pytest.raises(ValueError, match="unknown KV event kind 'moved'"):
        index.apply_kv_event("w1", "moved", (1,))


def test_capacities_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        SeenBlocks(capacity=0)
    with pytest.raises(ValueError, match="capacity_per_worker"):
        WorkerBlockIndex(capacity_per_worker=0)
