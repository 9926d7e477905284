"""Automatic prefix caching in the paged engine: hits, the free-block LRU, KV events the gateway can
match, copy-on-write on cached pages, and exactness that never rests on a hash."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

import engine_paged.block_manager as block_manager_module
from duet.hashing import block_hashes
from engine_core.engine_core import EngineCore
from engine_core.kv_pool import PageAllocator
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_paged.block_manager import BlockManager
from engine_paged.prefix_cache import PrefixCache
from tests.engine_paged.test_scheduler import CountingRunner, expected, make, req, run

PAGE = 4
MODEL = "model"


def cached_bm(num_pages: int = 32) -> BlockManager:
    return BlockManager(PageAllocator(num_pages), PAGE, watermark=0.0, prefix_cache=PrefixCache(MODEL, PAGE))


def compute(bm: BlockManager, seq_id, tokens: list[int], salt: str = "") -> int:
    """Admit `tokens` as a new sequence the way the scheduler does: cached prefix first, then the rest."""
    cached = bm.allocate_cached(seq_id, tokens, salt)
    bm.append_slots(seq_id, len(tokens) - cached)
    bm.cache_full_blocks(seq_id, tokens, len(tokens), salt)
    return cached


def test_a_repeated_prompt_hits_its_full_pages_and_leaves_a_token_to_compute():
    bm = cached_bm()
    prompt = list(range(1, 14))  # 13 tokens: 3 full pages + 1
    assert compute(bm, "a", prompt) == 0
    pages_a = list(bm.block_table("a"))
    bm.free("a")
    assert bm.num_used_pages == 0 and bm.num_free_pages == 32  # cached pages are reclaimable
    assert compute(bm, "b", prompt) == 12
    assert bm.block_table("b")[:3] == pages_a[:3]
    exact = list(range(1, 13))  # 12 tokens = 3 full pages: only 2 may hit, one token must run
    bm.free("b")
    assert compute(bm, "c", exact) == 8
    bm.check_integrity()


def test_kv_events_carry_the_gateways_hashes_and_evictions_follow_the_lru():
    bm = cached_bm(num_pages=6)
    prompt = list(range(100, 117))  # 4 full pages + 1
    compute(bm, "a", prompt, salt="tenant")
    [stored] = bm.take_kv_events()
    assert stored.kind == "stored" and stored.parent_hash == 0
    assert list(stored.block_hashes) == block_hashes(prompt, PAGE, MODEL, "tenant")
    bm.free("a")
    assert compute(bm, "other", list(range(200, 209)), salt="tenant") == 0  # needs 3 pages: 2 free + 1 evicted
    events = bm.take_kv_events()
    evicted = [h for e in events if e.kind == "evicted" for h in e.block_hashes]
    # the tail of the freed prompt goes first, so its head stays usable
    assert evicted == [stored.block_hashes[-1]]
    bm.free("other")
    assert compute(bm, "again", prompt, salt="tenant") == 12
    bm.check_integrity()


def test_a_different_salt_never_hits():
    bm = cached_bm()
    prompt = list(range(1, 10))
    compute(bm, "a", prompt, salt="x")
    assert compute(bm, "b", prompt, salt="y") == 0
    assert compute(bm, "c", prompt, salt="x") == 8
    bm.check_integrity()


def test_colliding_hashes_only_cost_hits_never_wrong_pages(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: 7)
    monkeypatch.setattr("engine_paged.prefix_cache.chain_hash", lambda parent, tokens: 7)
    bm = cached_bm()
    compute(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.free("a")
    assert compute(bm, "b", [1, 2, 3, 4, 9, 9, 9, 9, 9]) == 4  # block 0 truly matches; block 1 collides
    assert compute(bm, "c", [5, 5, 5, 5, 5, 5, 5, 5, 5]) == 0  # same hash, other tokens: a miss
    bm.check_integrity()


def test_forks_share_cached_pages_and_copy_on_write_leaves_them_alone():
    bm = cached_bm()
    prompt = list(range(1, 11))  # 2 full pages + 2
    compute(bm, "a", prompt)
    bm.free("a")
    compute(bm, "p", prompt)
    for i in range(3):
        bm.fork("p", f"c{i}")
    cached_pages = bm.block_table("p")[:2]
    for i in range(3):
        [(src, _)] = bm.append_slots(f"c{i}", 1)  # only the partial page is copied
        assert src not in cached_pages and bm.block_table(f"c{i}")[:2] == cached_pages
    bm.check_integrity()
    for s in ["p", "c0", "c1", "c2"]:
        bm.free(s)
    bm.check_integrity()
    assert bm.num_free_pages == bm.num_total_pages


def test_the_scheduler_reports_cached_tokens_and_gives_the_same_tokens():
    prompt = list(range(1, 23))  # 5 full pages + 2
    for cache in (False, True):
        sched = make(num_pages=64, page=PAGE, cache=cache)
        tokens = {}
        core = EngineCore(sched, CountingRunner())
        firsts = {}
        for rid in ("first", "second"):
            core.add(req(rid, prompt, 5, arrival=0, n=2))
            while core.has_unfinished():
                for o in core.step().outputs:
                    firsts.setdefault(o.request_id, o)
                    tokens.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        assert firsts["first"].cached_tokens == 0
        assert firsts["second"].cached_tokens == (20 if cache else 0)
        for key, got in tokens.items():
            assert got == expected(prompt, 5), key
        load = sched.load()
        assert load.prefix_cache_queries_tokens == 2 * len(prompt)
        assert load.prefix_cache_hits_tokens == (20 if cache else 0)
        sched.bm.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.integers(1, 12),
                          st.sampled_from(["one", "n", "beam"]), st.sampled_from(["", "s"])),
                min_size=1, max_size=14),
       st.integers(12, 40))
def test_random_workloads_keep_integrity_and_exact_tokens_with_the_cache(reqs, num_pages):
    """Shared heads, forks, beams, salts and preemption under a tight pool: every step keeps the
    block manager's and the cache's invariants, and every output is what the model says."""
    rng = random.Random(len(reqs) * 1000 + num_pages)
    heads = [[rng.randrange(1, 400) for _ in range(12)] for _ in range(4)]
    sched = make(num_pages=num_pages, page=PAGE, max_seqs=8, budget=24, cache=True)
    wanted = {}
    for i, (head, head_len, max_tokens, kind, salt) in enumerate(reqs):
        prompt = heads[head][:head_len] + [rng.randrange(1, 400) for _ in range(rng.randint(1, 6))]
        kw = {"n": 2} if kind == "n" else {"beam_width": 2} if kind == "beam" else {}
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
                    cache_salt=salt, arrival_time=i)
        sched.validate(r)
        sched.add(r)
        wanted[f"r{i}"] = (prompt, max_tokens, 2 if kind == "n" else 1)
    tokens, _, errors, _ = run(sched, CountingRunner())  # checks integrity after every step
    for rid, (prompt, max_tokens, outputs) in wanted.items():
        if errors[rid] is not None:  # only a request that cannot fit even alone may fail
            continue
        for index in range(outputs):
            assert tokens[(rid, index)] == expected(prompt, max_tokens), (rid, index)


def test_a_sequence_that_computed_known_blocks_again_stores_only_the_new_ones():
    """Two requests with one prompt head computed side by side: the second's copies of the head stay
    private (no event), and its first new block is stored with the head's last hash as parent."""
    bm = cached_bm()
    head = list(range(1, 13))  # 3 blocks
    bm.append_slots("a", len(head) + 1)
    bm.append_slots("c", len(head) + 5)  # computed in the same step as "a": no prefix reuse
    bm.cache_full_blocks("a", head + [60], len(head) + 1)
    [first] = bm.take_kv_events()
    tokens = head + [70, 71, 72, 73, 80]
    bm.cache_full_blocks("c", tokens, len(tokens))
    [event] = bm.take_kv_events()
    expected = block_hashes(tokens, PAGE, MODEL)
    assert list(first.block_hashes) == expected[:3]
    assert event.kind == "stored" and list(event.block_hashes) == expected[3:4] and event.parent_hash == expected[2]
    assert not set(bm.block_table("c")[:3]) & set(bm.block_table("a"))  # c's copies stay private
    bm.check_integrity()
    bm.free("a")
    bm.free("c")
    assert compute(bm, "d", tokens) == 16  # the chain continues through a's head into c's new block
    bm.check_integrity()


def test_evicting_a_block_a_later_prompt_hit_counts_as_a_reused_eviction():
    bm = cached_bm(num_pages=6)
    head = list(range(100, 109))  # 2 full pages + 1
    compute(bm, "a", head)
    bm.free("a")
    assert compute(bm, "b", head) == 8  # hit: both pages are reused now
    bm.free("b")
    assert bm.cache.reused_pages_evicted == 0
    compute(bm, "doc", list(range(300, 324)))  # 6 pages: every cached page goes
    assert bm.cache.reused_pages_evicted == 2
    bm.free("doc")
    compute(bm, "doc2", list(range(400, 424)))  # evicts doc's pages, which nobody hit
    assert bm.cache.reused_pages_evicted == 2
    bm.check_integrity()
