"""Canary (grey-release) variant choice: weighted arms, sticky per user or session.

A request's sticky key is hashed to a point u in [0, 1); the variants, in their configured
order, split [0, 1) into consecutive intervals proportional to their weights, and the arm
whose interval holds u wins. Because the point of a key never moves, a weight change only
moves the keys that sit between the old and the new interval edges: raising the canary's
weight from 10% to 20% moves 10% of users into the canary and nobody out of it.

`pick_variant` is routing's step 3 (gateway/routing/policy.py): the arm of one request, or the operator's
override, narrowed to the candidates that arm holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

from gateway.routing.route_types import (
    DEFAULT_VARIANT,
    NoCapableWorker,
    RouteRequest,
    RoutingConfig,
    UnknownVariant,
    Variant,
    WorkerView,
)

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


def pick_variant(
    req: RouteRequest, candidates: list[WorkerView], config: RoutingConfig
) -> tuple[str, list[WorkerView]]:
    """The canary arm of `req` and its candidates (routing's step 3). An override naming no variant
    raises UnknownVariant; an arm with no candidate left raises NoCapableWorker."""
    if not config.variants:
        if req.variant_override not in (None, DEFAULT_VARIANT):
            raise UnknownVariant(f"unknown variant {req.variant_override!r}; this model has only 'default'")
        return DEFAULT_VARIANT, candidates

    def members(v: Variant) -> list[WorkerView]:
        return [w for w in candidates if any(p.holds(w) for p in v.pools)]

    if req.variant_override is not None:
        v = next((v for v in config.variants if v.name == req.variant_override), None)
        if v is None:
            names = ", ".join(v.name for v in config.variants)
            raise UnknownVariant(f"unknown variant {req.variant_override!r}; configured: {names}")
        found = members(v)
        if not found:
            raise NoCapableWorker(f"variant {v.name!r} has no healthy worker able to serve this request")
        return v.name, found

    point = sticky_point(_sticky_key(req, config))
    usable = [(v, members(v)) for v in config.variants if v.weight > 0]
    chosen = pick_weighted(point, usable, [v.weight for v, _ in usable])
    if chosen[1]:
        return chosen[0].name, chosen[1]
    # the key's arm cannot serve this request: same point over the arms that can
    usable = [(v, m) for v, m in usable if m]
    if not usable:
        raise NoCapableWorker("no canary variant has a healthy worker able to serve this request")
    v, found = pick_weighted(point, usable, [v.weight for v, _ in usable])
    return v.name, found


STICKY_BLOCKS = 4  # an anonymous request's sticky key reads this many leading block hashes (and its length)


def _sticky_key(req: RouteRequest, config: RoutingConfig) -> str:
    first, second = (req.session_key, req.user_key)
    if config.sticky_key == "user":
        first, second = second, first
    if first is not None:
        return first
    if second is not None:
        return second
    # anonymous: spread by prompt head, so identical prompts land in the same arm
    return "prompt:" + ",".join(map(str, req.block_hashes[:STICKY_BLOCKS])) + f":{req.num_prompt_tokens}"
