"""Reuse-aware eviction in the radix cache (engine_prefix's default, `--cache-eviction reuse-aware`): a burst
of one-shot documents evicts other documents, not a system prompt that requests have reused; under plain
LRU (`--cache-eviction lru`) the same burst evicts it. Driven through the real scheduler over the tiny
model, and on the cache alone."""

from __future__ import annotations

import random

import pytest

from engine_core.kv_pool import PageAllocator
from engine_prefix.radix_cache import RadixCache
from tests.engine_prefix.test_prefix_scheduler import Driver, rand_tokens

SYSTEM = 128  # tokens: 8 pages of 16


def _burst_then_return(checkpoint, eviction: str) -> tuple[int, int]:
    """Two chats share a system prompt, then eight one-shot documents pass through a 640-token cache, two at
    a time (their running pages fit beside the head: what is tested is the choice among cached pages);
    returns (cached tokens of a third chat, reused pages the cache evicted)."""
    rng = random.Random(7)
    d = Driver(checkpoint, prefix={"cache_eviction": eviction}, kv_cache_tokens=640, max_num_seqs=2)
    system = rand_tokens(rng, SYSTEM)
    for i in range(2):
        d.add(f"chat-{i}", system + rand_tokens(rng, 20))
        d.run()
    assert d.first["chat-1"].cached_tokens == SYSTEM  # the second chat reused the head
    for i in range(8):  # 8 x 200 tokens: two and a half times the cache
        d.add(f"doc-{i}", rand_tokens(rng, 200))
    d.run()
    assert all(d.first[f"doc-{i}"].cached_tokens == 0 for i in range(8))
    d.add("chat-2", system + rand_tokens(rng, 20))
    d.run()
    return d.first["chat-2"].cached_tokens, d.s.load().reused_pages_evicted


def test_a_document_burst_keeps_the_reused_system_prompt_under_reuse_aware_eviction(tiny_checkpoint):
    cached, reused_evicted = _burst_then_return(tiny_checkpoint, "reuse-aware")
    assert cached == SYSTEM and reused_evicted == 0


def test_the_same_burst_evicts_it_under_lru(tiny_checkpoint):
    cached, reused_evicted = _burst_then_return(tiny_checkpoint, "lru")
    assert cached == 0 and reused_evicted >= SYSTEM // 16


@pytest.mark.parametrize("protect", [True, False])
def test_eviction_order_on_the_cache_alone(protect):
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, 2, protect_reused=protect)
    head = [1, 1, 2, 2]
    cache.insert(head, alloc.alloc(2))
    cache.mark_reused(cache.match_prefix(head).node)
    cache.insert([7, 7, 8, 8], alloc.alloc(2))  # newer, never reused
    assert cache.evict(2) == 2
    assert cache.match_prefix(head).length == (4 if protect else 0)
    assert cache.reused_pages_evicted == (0 if protect else 2)
    cache.check_integrity()


def test_reuse_survives_a_split():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, 2, protect_reused=True)
    cache.insert([1, 1, 2, 2, 3, 3], alloc.alloc(3))
    cache.mark_reused(cache.match_prefix([1, 1, 2, 2, 3, 3]).node)
    cache.match_prefix([1, 1, 9, 9])  # splits the node after one page
    cache.insert([5, 5], alloc.alloc(1))
    cache.evict(1)
    assert cache.match_prefix([1, 1, 2, 2, 3, 3]).length == 6
    assert cache.reused_pages_evicted == 0


def _cold_and_hot(checkpoint, aging_s: float) -> list[str]:
    """A zero-match prompt that has waited 10 s and a fresh one whose 64 tokens are cached, one slot:
    which runs first."""
    import time

    from engine_core.request import Request
    from tests.engine_prefix.test_prefix_scheduler import GREEDY

    rng = random.Random(3)
    d = Driver(checkpoint, prefix={"aging_s": aging_s}, kv_cache_tokens=4096, max_num_seqs=1)
    hot = rand_tokens(rng, 64)
    d.add("warm", hot + [5])
    d.run()
    for rid, prompt, arrival in (("cold", rand_tokens(rng, 70), time.monotonic() - 10.0),
                                 ("hot", hot + [9, 9], time.monotonic())):
        d.s.add(Request(rid, prompt, GREEDY, arrival_time=arrival))
        d.tokens[rid] = []
    d.step()
    first = d.batches[-1]
    d.run()
    return first


def test_a_prompt_that_waited_past_the_aging_bound_goes_ahead_of_cache_order(tiny_checkpoint):
    assert _cold_and_hot(tiny_checkpoint, 2.0) == ["cold"]


def test_without_aging_cache_order_keeps_it_waiting(tiny_checkpoint):
    assert _cold_and_hot(tiny_checkpoint, 0.0) == ["hot"]


def test_aging_orders_the_overdue_by_arrival_and_the_rest_by_cached_prefix():
    from engine_prefix.policy import Candidate, Policy, order

    cands = [Candidate("hot", 64, None, 0, 9.5), Candidate("cold-old", 0, None, 0, 1.0),
             Candidate("cold-older", 0, None, 0, 0.5), Candidate("warm", 32, None, 0, 9.0)]
    assert [c.item for c in order(cands, Policy.LPM, now=10.0, aging_s=2.0)] == ["cold-older", "cold-old", "hot", "warm"]
    assert [c.item for c in order(cands, Policy.LPM)] == ["hot", "warm", "cold-older", "cold-old"]
