"""The radix cache against a naive reference: a dict from every cached page-aligned prefix to its page.

Random inserts (with and without a prior match), matches, locks, unlocks and evictions; after each step the
cache answers like the reference and check_integrity() holds (free + evictable + protected == total)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.kv_pool import PageAllocator
from engine_prefix.radix_cache import RadixCache, common_len

PAGE = 2
NUM_PAGES = 48

tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)
salt_st = st.sampled_from(["", "tenant-b"])


def _ref_match(ref: dict[tuple, int], tokens: list[int]) -> list[int]:
    pages = []
    for end in range(PAGE, len(tokens) + 1, PAGE):
        page = ref.get(tuple(tokens[:end]))
        if page is None:
            break
        pages.append(page)
    return pages


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.cache = RadixCache(self.alloc, PAGE)
        self.ref: dict[str, dict[tuple, int]] = {"": {}, "tenant-b": {}}
        self.held: list[tuple] = []  # (node, salt, tokens, pages) of locked matches

    def _alloc(self, n: int) -> list[int] | None:
        if self.alloc.num_free < n:
            self.cache.evict(n - self.alloc.num_free)
            self._sync_after_evict()
        if self.alloc.num_free < n:
            return None
        return self.alloc.alloc(n)

    def _sync_after_evict(self) -> None:
        # Evicted prefixes leave the reference; what stays must still be cached with the same page.
        for salt, ref in self.ref.items():
            for prefix in list(ref):
                m = self.cache.match_prefix(list(prefix), salt)
                if m.length < len(prefix):
                    del ref[prefix]
                else:
                    assert m.pages[-1] == ref[prefix]
            for prefix in ref:  # prefix-closed: evicting a node never strands its descendants
                assert len(prefix) == PAGE or prefix[:-PAGE] in ref

    @rule(tokens=tokens_st, salt=salt_st)
    def match(self, tokens, salt):
        m = self.cache.match_prefix(tokens, salt)
        expected = _ref_match(self.ref[salt], tokens)
        assert m.pages == expected and m.length == len(expected) * PAGE

    @rule(tokens=tokens_st, salt=salt_st)
    def insert_after_match(self, tokens, salt):
        m = self.cache.match_prefix(tokens, salt)
        self.cache.lock(m.node)  # the request's cached prefix must survive its own allocation's eviction
        new = self._alloc(len(tokens) // PAGE - len(m.pages))
        self.cache.unlock(m.node)
        if new is None:
            return
        res = self.cache.insert(tokens, m.pages + new, salt)
        assert res.prefix_len == m.length and res.duplicate_pages == []
        for i, page in enumerate(m.pages + new):
            self.ref[salt][tuple(tokens[: (i + 1) * PAGE])] = page

    @rule(tokens=tokens_st, salt=salt_st)
    def insert_fresh(self, tokens, salt):
        # A request that computed everything itself: the cached part comes back as duplicates to free.
        expected = _ref_match(self.ref[salt], tokens)
        own = self._alloc(len(tokens) // PAGE)
        if own is None:
            return
        expected = _ref_match(self.ref[salt], tokens)  # allocation may have evicted
        res = self.cache.insert(tokens, own, salt)
        assert res.prefix_len == len(expected) * PAGE
        assert res.duplicate_pages == own[: len(expected)]
        self.alloc.free(res.duplicate_pages)
        for i in range(len(expected), len(own)):
            self.ref[salt][tuple(tokens[: (i + 1) * PAGE])] = own[i]

    @rule(tokens=tokens_st, salt=salt_st)
    def lock(self, tokens, salt):
        m = self.cache.match_prefix(tokens, salt)
        self.cache.lock(m.node)
        self.held.append((m.node, salt, tokens[: m.length], m.pages))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, *_ = self.held.pop(i % len(self.held))
        self.cache.unlock(node)

    @rule(n=st.integers(0, NUM_PAGES))
    def evict(self, n):
        evictable = self.cache.evictable_pages
        free_before = self.alloc.num_free
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable)
        assert self.alloc.num_free == free_before + freed
        self._sync_after_evict()
        for _, salt, tokens, pages in self.held:  # locked prefixes are never evicted
            assert self.cache.match_prefix(tokens, salt).pages == pages

    @invariant()
    def integrity(self):
        self.cache.check_integrity()
        assert self.cache.cached_pages == sum(len(r) for r in self.ref.values())


TestRadixCache = RadixMachine.TestCase
TestRadixCache.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_lru_evicts_least_recently_used_leaf_first():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, 2)
    cache.insert([1, 1, 2, 2], alloc.alloc(2))
    shared = cache.match_prefix([1, 1]).pages
    cache.insert([1, 1, 3, 3], shared + alloc.alloc(1))
    cache.match_prefix([1, 1, 2, 2])  # [2, 2] is now more recent than [3, 3]
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 1, 3, 3]).length == 2
    assert cache.match_prefix([1, 1, 2, 2]).length == 4
    cache.check_integrity()


def test_match_splits_on_partial_match_and_tenants_never_share():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, 2)
    pages = alloc.alloc(3)
    cache.insert([5, 6, 7, 8, 9, 10], pages)
    m = cache.match_prefix([5, 6, 7, 8, 0, 0])
    assert m.length == 4 and m.pages == pages[:2]
    cache.lock(m.node)
    assert cache.protected_pages == 2 and cache.evictable_pages == 1
    assert cache.match_prefix([5, 6, 7, 8], salt="other").length == 0
    assert cache.evict(3) == 1  # only the unlocked tail can go
    cache.unlock(m.node)
    cache.check_integrity()
    cache.reset()
    assert alloc.num_free == 8 and cache.cached_pages == 0
    cache.check_integrity()


# ---- common_len: the prefix compare every match and insert walks -------------------------------------------

def _common_len_reference(key, tokens, pos, end, page_size):
    """The definition, token by token."""
    n, limit = 0, min(len(key), end - pos)
    while n < limit and key[n] == tokens[pos + n]:
        n += 1
    return n - n % page_size


def test_common_len_at_the_edges():
    P = 4
    key = tuple(range(100, 112))  # 3 pages
    assert common_len((), [1, 2, 3, 4], 0, 4, P) == 0  # empty key
    assert common_len(key, [], 0, 0, P) == 0  # empty tokens
    assert common_len(key, list(key), 0, 12, P) == 12  # full match
    assert common_len(key, tuple(key), 0, 12, P) == 12  # tuples too
    assert common_len(key, [0] + list(key), 1, 13, P) == 12  # from pos
    assert common_len(key, [9] + list(key[1:]), 0, 12, P) == 0  # first token differs
    assert common_len(key, list(key[:-1]) + [9], 0, 12, P) == 8  # last token differs: two whole pages
    assert common_len(key, list(key[:5]) + [9] * 7, 0, 12, P) == 4  # mid-page mismatch rounds down
    assert common_len(key, list(key), 0, 10, P) == 8  # end not a page multiple: whole pages only
    assert common_len(key, list(key) + [7] * 8, 0, 20, P) == 12  # tokens longer than the key
    assert common_len(key, list(key[:7]), 0, 7, P) == 4  # tokens shorter than a page multiple
    assert common_len(key, list(key), 3, 2, P) == 0  # end before pos


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(0, 700), st.integers(0, 700), st.integers(0, 20), st.data())
def test_common_len_is_the_token_by_token_definition(page_size, key_len, mismatch, pos, data):
    """Chunks double and halve around the mismatch: any mismatch position, length and page size agrees."""
    key = tuple(range(key_len))
    tokens = [-1] * pos + list(key) + data.draw(st.lists(st.integers(0, 3), max_size=20))
    if mismatch < len(key):
        tokens[pos + mismatch] = -5
    end = data.draw(st.integers(pos, len(tokens)))
    got = common_len(key, tokens, pos, end, page_size)
    assert got == _common_len_reference(key, tokens, pos, end, page_size)
