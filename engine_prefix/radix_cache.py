"""A radix tree over token ids whose edges own KV pages of the shared pool.

Contracts
- Page-aligned: every node's key holds a whole number of pages (``len(key) == len(pages) * page_size``);
  only full pages are ever cached. The tail of a prompt shorter than a page stays private to its request.
- One tree per ``cache_salt``: tenants never share a cached prefix, so a salt can never probe another's.
- ``match_prefix`` never changes what is cached: it touches access times and may split a node at a page
  boundary so the match ends on a node (the handle to lock).
- ``insert`` de-duplicates: it returns how many leading tokens were already cached. The tree takes ownership
  of the caller's pages past that point; pages before it stay the caller's, and any of them that differ from
  the tree's are duplicates the caller must free (``InsertResult.duplicate_pages`` lists them).
- Pages returned by a match are only safe to use while its node is locked (``lock``); locked nodes and their
  ancestors are protected, everything else is evictable, leaves first, least recently used first.
- Eviction order (``protect_reused``): off, plain LRU over leaves. On, leaves no request has ever matched
  (one-shot prompts) go before leaves some request reused (a shared system prompt, a conversation's history),
  LRU within each group: a burst of unrelated documents then evicts other documents before a live prefix.
  ``mark_reused`` (called at admission on a hit) sets the flag; ``reused_pages_evicted`` counts what eviction
  still took from the reused group (the figure `duet bench classes` reports).
- ``check_integrity`` proves: free + evictable + protected (+ pages private to running requests) == total,
  every page is owned exactly once, lock counts agree with the sizes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from engine_core.kv_pool import Allocator


def common_len(key: tuple[int, ...], tokens: Sequence[int], pos: int, end: int, page_size: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:end]``, rounded down to whole pages.

    Every match and insert runs it on each node of the path, so it compares slices (in C), not tokens (in
    Python): chunks that double while they match and halve after a miss, down to one page. A long match
    costs O(log) slice compares, and a miss a page or two in stays as cheap as it was token by token."""
    limit = max(0, min(len(key), end - pos))
    limit -= limit % page_size  # a partial page never counts
    n, step = 0, page_size
    while n < limit:
        step = min(step, limit - n)
        if key[n:n + step] == tuple(tokens[pos + n:pos + n + step]):
            n += step
            step *= 2
        elif step > page_size:
            step = max(page_size, step // 2 - step // 2 % page_size)
        else:
            break
    return n


class CacheListener(Protocol):
    """Told when whole pages enter or leave the tree (KV events, see kv_events.py)."""

    def on_stored(self, cache: RadixCache, node: Node) -> None: ...

    def on_evicted(self, cache: RadixCache, node: Node) -> None: ...

    def on_cleared(self, cache: RadixCache) -> None: ...


class Node:
    """One edge of the tree: ``key`` tokens stored in ``pages``; ``lock_ref`` counts requests using it."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "pages", "parent", "reused", "salt")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, salt: str, now: int) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = now
        self.salt = salt
        self.reused = False  # some request matched this node after it was stored (mark_reused)

    @property
    def is_root(self) -> bool:
        return self.parent is None


class MatchResult(NamedTuple):
    """The longest cached page-aligned prefix: its pages in order, its length in tokens, the node to lock."""

    node: Node
    pages: list[int]
    length: int


class InsertResult(NamedTuple):
    """``prefix_len`` tokens were already cached; ``duplicate_pages`` are the caller's pages the tree did not
    take (they duplicate cached ones: free them); ``node`` ends the inserted path."""

    node: Node
    prefix_len: int
    duplicate_pages: list[int]


class RadixCache:
    def __init__(self, allocator: Allocator, page_size: int, listener: CacheListener | None = None,
                 protect_reused: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.listener = listener
        self._clock = itertools.count(1)
        self._roots: dict[str, Node] = {}
        self.evictable_pages = 0
        self.protected_pages = 0
        self.protect_reused = protect_reused
        self.reused_pages_evicted = 0

    # ---- queries -------------------------------------------------------------------------------------------

    def root(self, salt: str = "") -> Node:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = Node((), [], None, salt, 0)
            node.lock_ref = 1  # roots are never evicted
        return node

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def match_prefix(self, token_ids: Sequence[int], salt: str = "") -> MatchResult:
        """Longest cached prefix of ``token_ids`` (whole pages). Touches access times along the path."""
        now = next(self._clock)
        node = self.root(salt)
        node.last_access = now
        pages: list[int] = []
        usable = len(token_ids) - len(token_ids) % self.page_size
        pos = 0
        while pos < usable:
            child = node.children.get(tuple(token_ids[pos : pos + self.page_size]))
            if child is None:
                break
            n = common_len(child.key, token_ids, pos, usable, self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += n
            node = child
        return MatchResult(node, pages, pos)

    # ---- updates -------------------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], salt: str = "") -> InsertResult:
        """Cache ``token_ids[:len(pages)*page_size]`` (only whole pages) stored in ``pages``.

        The tree takes every page past the already-cached prefix; see InsertResult for the rest."""
        num_pages = min(len(pages), len(token_ids) // self.page_size)
        length = num_pages * self.page_size
        now = next(self._clock)
        node = self.root(salt)
        node.last_access = now
        duplicates: list[int] = []
        pos = 0
        prefix_len = length
        while pos < length:
            first = tuple(token_ids[pos : pos + self.page_size])
            child = node.children.get(first)
            if child is None:
                new = Node(tuple(token_ids[pos:length]), list(pages[pos // self.page_size : num_pages]), node, salt, now)
                node.children[first] = new
                self.evictable_pages += len(new.pages)
                prefix_len = pos
                node = new
                if self.listener is not None:
                    self.listener.on_stored(self, new)
                break
            n = common_len(child.key, token_ids, pos, length, self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            first_page = pos // self.page_size
            for own, cached in zip(pages[first_page : first_page + len(child.pages)], child.pages):
                if own != cached:
                    duplicates.append(own)
            pos += n
            node = child
        return InsertResult(node, prefix_len, duplicates)

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (one reference per call)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def mark_reused(self, node: Node) -> None:
        """A request hit the prefix ending at ``node``: it and its ancestors are reused prefixes."""
        while not node.is_root and not node.reused:
            node.reused = True
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        """Drop one reference taken by ``lock(node)``."""
        while not node.is_root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_pages -= len(node.pages)
                self.evictable_pages += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if that many are evictable, least recently used leaves first
        (never-reused leaves before reused ones with ``protect_reused``).

        Returns the number of pages freed (less than asked only when nothing evictable is left)."""
        if num_pages <= 0:
            return 0
        order = itertools.count()  # ties: insertion order, so nodes are never compared
        heap = [self._evict_key(n, next(order)) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            if leaf.reused:
                self.reused_pages_evicted += len(leaf.pages)
            if self.listener is not None:
                self.listener.on_evicted(self, leaf)  # while the leaf is still attached (its path is known)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, self._evict_key(parent, next(order)))
        return freed

    def _evict_key(self, node: Node, tie: int) -> tuple[bool, int, int, Node]:
        return (self.protect_reused and node.reused, node.last_access, tie, node)

    def reset(self) -> None:
        """Drop the whole cache and free its pages. Only valid while no node is locked."""
        assert self.protected_pages == 0, "reset while requests hold cached prefixes"
        for node in list(self._nodes()):
            self.allocator.free(node.pages)
        self._roots.clear()
        self.evictable_pages = 0
        if self.listener is not None:
            self.listener.on_cleared(self)

    # ---- internals -----------------------------------------------------------------------------------------

    def path_tokens(self, node: Node) -> list[int]:
        """All tokens from the root to the end of ``node`` (O(depth))."""
        parts: list[tuple[int, ...]] = []
        while not node.is_root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for key in reversed(parts) for t in key]

    def _nodes(self) -> Iterable[Node]:
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child`` after ``n`` tokens (a page multiple); returns the new upper node."""
        assert 0 < n < len(child.key) and n % self.page_size == 0
        parent = child.parent
        assert parent is not None
        k = n // self.page_size
        upper = Node(child.key[:n], child.pages[:k], parent, child.salt, child.last_access)
        upper.lock_ref = child.lock_ref  # same requests hold both halves: sizes do not change
        upper.reused = child.reused
        parent.children[child.key[: self.page_size]] = upper
        child.key = child.key[n:]
        child.pages = child.pages[k:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def check_integrity(self, private_pages: Iterable[int] = ()) -> None:
        """Raise AssertionError unless the cache's bookkeeping is exact.

        ``private_pages``: pages held by running requests outside the tree (their unshared suffixes)."""
        seen: set[int] = set()
        evictable = protected = 0
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.pages) * self.page_size, "node not page-aligned"
            assert node.parent is not None and node.parent.children.get(node.key[: self.page_size]) is node
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "a child holds more locks than its parent"
            for p in node.pages:
                assert p not in seen, f"page {p} owned twice in the tree"
                seen.add(p)
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        assert evictable == self.evictable_pages, f"evictable {self.evictable_pages} != counted {evictable}"
        assert protected == self.protected_pages, f"protected {self.protected_pages} != counted {protected}"
        private = list(private_pages)
        assert not seen.intersection(private), "a private page is also in the tree"
        assert len(set(private)) == len(private), "a private page is held twice"
        total = self.allocator.num_free + evictable + protected + len(private)
        assert total == self.allocator.num_total, (
            f"free {self.allocator.num_free} + evictable {evictable} + protected {protected} + "
            f"private {len(private)} != total {self.allocator.num_total}"
        )
