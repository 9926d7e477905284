"""The order in which waiting requests are admitted: cache-aware by default.

- ``lpm`` (longest prefix match first): requests whose prompt is most cached run first, so the cache
  they hit is used before it can be evicted.
- ``dfs-weight``: walk the radix tree depth first, heaviest subtree (most waiting requests under it) first;
  requests that share a subtree run together, keeping one branch hot at a time.
- ``fcfs``: priority, then arrival. Also the fallback for the other two when the queue is longer than
  ``fcfs_fallback_queue`` (matching every waiting prompt each step would cost more than it saves).

Aging (``aging_s``, `--aging-s`, default 2 s): under lpm and dfs-weight a request that has waited ``aging_s``
or longer goes ahead of the cache-aware order, oldest first. Cache-ordered admission otherwise starves a
zero-match prompt (a one-shot document) for as long as requests with cached prefixes keep arriving; 2 s is the
interactive TTFT bound on the bench machine (duet/traffic_classes.py: `session` at the cpu profile) - a request
that has waited that long is late for any class, so from then on arrival order is fairer than cache order. 0 turns aging off.

Within any order, ``InBatchDedup`` holds back a request whose not-yet-cached prefix is being computed by one
admitted earlier in the same step: one goes first, the rest hit the cache a step later instead of each
computing the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from duet.hashing import block_hashes
from engine_prefix.radix_cache import Node


class Policy(str, Enum):
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"
    FCFS = "fcfs"

    @classmethod
    def parse(cls, name: str | None) -> Policy:
        if name is None:
            return cls.LPM
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown schedule policy {name!r}; choose lpm, dfs-weight or fcfs") from None


@dataclass
class Candidate:
    """A waiting request as the policy sees it: ``item`` is the scheduler's own object."""

    item: Any
    prefix_len: int  # tokens already cached
    node: Node | None  # where its match ends (None when not matched: FCFS)
    priority: int
    arrival: float


def order(cands: Sequence[Candidate], policy: Policy, now: float | None = None,
          aging_s: float = 0.0) -> list[Candidate]:
    """The candidates in admission order (those waiting ``aging_s`` or longer at ``now`` first, by arrival)."""
    fcfs_key = lambda c: (c.priority, c.arrival)
    if policy is Policy.FCFS:
        return sorted(cands, key=fcfs_key)
    if aging_s > 0 and now is not None:
        overdue = [c for c in cands if now - c.arrival >= aging_s]
        if overdue:
            rest = [c for c in cands if now - c.arrival < aging_s]
            return sorted(overdue, key=lambda c: c.arrival) + order(rest, policy)
    if policy is Policy.LPM:
        return sorted(cands, key=lambda c: (-c.prefix_len, c.priority, c.arrival))
    return _dfs_weight(cands, fcfs_key)


def _dfs_weight(cands: Sequence[Candidate], tie_key) -> list[Candidate]:
    weight: dict[int, int] = {}
    at: dict[int, list[Candidate]] = {}
    roots: dict[int, Node] = {}
    for c in cands:
        node = c.node
        assert node is not None, "dfs-weight needs every candidate matched"
        at.setdefault(id(node), []).append(c)
        while True:
            weight[id(node)] = weight.get(id(node), 0) + 1
            if node.parent is None:
                roots[id(node)] = node
                break
            node = node.parent
    out: list[Candidate] = []
    stack = sorted(roots.values(), key=lambda n: weight[id(n)])  # heaviest popped first
    while stack:
        node = stack.pop()
        out.extend(sorted(at.get(id(node), []), key=tie_key))
        children = [ch for ch in node.children.values() if id(ch) in weight]
        stack.extend(sorted(children, key=lambda n: weight[id(n)]))
    return out


class InBatchDedup:
    """Tracks the page-aligned prefixes admitted this step (as chained page hashes)."""

    def __init__(self, page_size: int, min_shared_tokens: int) -> None:
        self.page_size = page_size
        self.min_shared_pages = max(1, -(-min_shared_tokens // page_size))
        self._admitted: set[int] = set()

    def should_wait(self, tokens: Sequence[int], salt: str, cached_len: int) -> bool:
        """True when a request admitted this step is computing at least ``min_shared_tokens`` of this
        prompt's uncached prefix."""
        if not self._admitted:
            return False
        hashes = self._hashes(tokens, salt)
        shared = 0
        while shared < len(hashes) and hashes[shared] in self._admitted:
            shared += 1
        return shared - cached_len // self.page_size >= self.min_shared_pages

    def admit(self, tokens: Sequence[int], salt: str) -> None:
        self._admitted.update(self._hashes(tokens, salt))

    def _hashes(self, tokens: Sequence[int], salt: str) -> list[int]:
        # the salt goes into the chain: tenants never wait on (or share with) each other
        return block_hashes(tokens, self.page_size, "dedup", salt)
