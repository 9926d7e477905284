"""KV events carry exactly the block hashes the gateway computes for the same prompt and tenant."""

from __future__ import annotations

import pytest

from duet.hashing import block_hashes
from engine_core.kv_pool import PageAllocator
from engine_prefix.kv_events import KvEventRecorder
from engine_prefix.radix_cache import RadixCache

MODEL = "tiny-llama"


@pytest.mark.parametrize("page_size,block_size", [(4, 4), (2, 4), (4, 2), (3, 4)])
def test_stored_and_evicted_blocks_match_gateway_hashes(page_size, block_size):
    alloc = PageAllocator(64)
    rec = KvEventRecorder(MODEL, block_size)
    cache = RadixCache(alloc, page_size, listener=rec)
    a = list(range(100, 124))
    b = a[:12] + list(range(500, 512))  # shares the first 12 tokens with a
    for salt in ("", "tenant"):
        for prompt in (a, b):
            m = cache.match_prefix(prompt, salt)
            new = alloc.alloc(len(prompt) // page_size - len(m.pages))
            cache.insert(prompt, m.pages + new, salt)
    events = rec.take()
    stored = [h for e in events for h in e.block_hashes]
    assert all(e.kind == "stored" for e in events)
    expected = set()
    for salt in ("", "tenant"):
        for prompt in (a, b):
            cached = len(prompt) - len(prompt) % page_size
            expected.update(block_hashes(prompt[:cached], block_size, MODEL, salt))
    assert sorted(stored) == sorted(expected)  # each block stored once, none invented
    for e in events:  # the parent hash chains each event onto the blocks before it (0 at the root)
        assert e.parent_hash == 0 or e.parent_hash in expected

    cache.evict(alloc.num_total)
    evicted = [h for e in rec.take() for h in e.block_hashes]
    assert sorted(evicted) == sorted(expected)
    cache.check_integrity()


def test_reset_emits_cleared():
    alloc = PageAllocator(8)
    rec = KvEventRecorder(MODEL, 2)
    cache = RadixCache(alloc, 2, listener=rec)
    cache.insert([1, 2, 3, 4], alloc.alloc(2))
    cache.reset()
    assert [e.kind for e in rec.take()] == ["cleared"]
