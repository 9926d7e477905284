"""Canary (grey-release) variant choice: weighted arms, sticky per user or session.

A request's sticky key is hashed to a point u in [0, 1); the variants, in their configured
order, split [0, 1) into consecutive intervals proportional to their weights, and the arm
whose interval holds u wins. Because the point of a key never moves, a weight change only
moves the keys that sit between the old and the new interval edges: raising the canary's
weight from 10% to 20% moves 10% of users into the canary and nobody out of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

V = TypeVar("V")


def sticky_point(key: str) -> float:
    """A stable point in [0, 1) for `key`: the same on every gateway replica and every run
    (Python's hash() is salted per process, so a cryptographic digest is used instead)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def pick_weighted(point: float, items: Sequence[V], weights: Sequence[float]) -> V:
    """The item whose cumulative-weight interval holds `point` (0 <= point < 1).

    Weights need not sum to one (they are normalized); items of weight 0 are never picked.
    Raises ValueError when no weight is positive."""
    if len(items) != len(weights) or not items:
        raise ValueError("pick_weighted needs one weight per item and at least one item")
    total = float(sum(w for w in weights if w > 0))
    if total <= 0:
        raise ValueError("every canary weight is zero: no variant can take traffic")
    target = point * total
    acc = 0.0
    last = None
    for item, w in zip(items, weights):
        if w <= 0:
            continue
        acc += w
        last = item
        if target < acc:
            return item
    return last  # float rounding at the top edge
