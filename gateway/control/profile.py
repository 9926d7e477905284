"""The live workload profile: what the traffic looks like, per model and overall, over a sliding window.

The first step of choosing a deployment is to characterize the traffic where it is. The gateway calls
`WorkloadProfile.record(...)` once per successful request (gateway/control/workload.py) and `snapshot(window_s)`
answers, per model and for all models together (`"*"`):

- prefix repetition: the share of the prompt's routing blocks (duet/contract.py HASH_BLOCK_TOKENS tokens each,
  the chained hashes dispatch already computed) seen before, split into blocks this request's own session sent
  first (`within_session`) and blocks another session or a session-less request sent first (`cross_session`);
- prompt and output length distributions, session length in turns (histograms with fixed bounds);
- arrival rate, mean concurrency (Little's law: the requests' busy seconds over the window) and peak
  concurrency (the most requests in flight at once, from every request's span, not the sample);
- the traffic-class mix (duet/traffic_classes.py) and each engine kind's prefix hit rate (cached/prompt tokens).

Memory is bounded: at most `max_requests` requests are kept (older than `max_window_s` dropped), and the block
owners live in two generations of at most `max_blocks` hashes each (when the young one fills, the old one is
dropped; 27 MB under tracemalloc at the defaults, 50,000 requests and 180,000 blocks). A block evicted that
way counts as new when it comes back.

A snapshot reads at most `SAMPLE` requests per model (every k-th of the window's; the rate and the concurrency
are scaled by the true count) and is kept for a second: at 50,000 requests in the window a snapshot took 82 ms
on a loaded 2-core VM where reading every request took 1.4 s (the dashboard, /metrics and the admin API read it).
The peak concurrency still reads every request, once for a deployment of one model (its profile is the overall
one): 28 ms of CPU a snapshot at 50,000 requests against 68 ms computing it twice by binary searches (loaded Zen 4,
2026-12-06), time the event loop serves nothing else.

Chained hashes make "seen" monotone along a prompt (block i seen implies blocks before i seen), so the seen
prefix and the boundary between other sessions' blocks and this session's own are found by binary search: a
few dict lookups per request, whatever the prompt's length, plus one C-level `dict.update` of the new blocks.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

ALL = "*"  # the snapshot's key for every model together
SAMPLE = 2000  # requests a snapshot reads per model at most (module docstring)
SNAPSHOT_TTL_S = 1.0
PROMPT_BOUNDS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # tokens; a last bucket above
OUTPUT_BOUNDS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TURN_BOUNDS = (1, 2, 3, 5, 10, 20)


class Finished(NamedTuple):
    """One profiled request's fields. The ring keeps each as a plain tuple in this order (`record`), and only a
    snapshot's sample is made into `Finished`: Python's cyclic GC stops tracking a plain tuple of strings and
    numbers at its first collection, but never a tuple subclass, so 50,000 `Finished` in the ring were 50,000
    more objects every full collection walked (in a gateway at 1,000 streams, ~4 full collections per 1,000
    requests, each walking ~90,000 objects of its own: docs/benchmarks.md)."""

    start: float  # clock() at arrival
    end: float  # clock() at its last byte
    model: str
    session: str  # "" none
    turns: int  # user turns in the request (a session's length is its largest)
    prompt_tokens: int
    output_tokens: int
    blocks: int  # full routing blocks hashed
    within_session: int  # of them, first sent by this session
    cross_session: int  # of them, first sent by another session (or a session-less request)
    traffic_class: str
    engine: str
    cached_tokens: int


_START, _END, _MODEL = (Finished._fields.index(f) for f in ("start", "end", "model"))


class BlockOwners:
    """Which session first sent each block hash, in two bounded generations (module docstring)."""

    def __init__(self, max_blocks: int = 100_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._young: dict[int, object] = {}
        self._old: dict[int, object] = {}

    def _owner(self, h: int) -> object | None:
        owner = self._young.get(h)
        return self._old.get(h) if owner is None else owner

    def classify(self, hashes: Sequence[int], owner: object) -> tuple[int, int]:
        """(blocks first sent by `owner`, blocks first sent by someone else) among `hashes`, a chain; then
        remembers the new blocks as `owner`'s."""
        lo, hi = 0, len(hashes)
        while lo < hi:  # seen = the longest prefix already known
            mid = (lo + hi) // 2
            if self._owner(hashes[mid]) is None:
                hi = mid
            else:
                lo = mid + 1
        seen = lo
        lo, hi = 0, seen
        while lo < hi:  # within the seen prefix: other sessions' blocks first, then the owner's own
            mid = (lo + hi) // 2
            if self._owner(hashes[mid]) == owner:
                hi = mid
            else:
                lo = mid + 1
        others = lo
        young = self._young
        if seen and hashes[seen - 1] not in young:  # known from the old generation only: keep it alive
            young.update({h: self._owner(h) for h in hashes[:seen]})
        young.update(dict.fromkeys(hashes[seen:], owner))
        if len(young) > self.max_blocks:
            self._old, self._young = young, {}
        return seen - others, others

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


class WorkloadProfile:
    def __init__(self, max_window_s: float = 300.0, max_requests: int = 50_000, max_blocks: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_window_s <= 0 or max_requests < 1:
            raise ValueError("WorkloadProfile needs max_window_s > 0 and max_requests >= 1")
        self.max_window_s = max_window_s
        self.clock = clock
        self._requests: deque[tuple] = deque(maxlen=max_requests)  # Finished's fields, plain tuples
        self._owners = BlockOwners(max_blocks)
        self._anonymous = itertools.count()  # the owner of a session-less request's blocks: itself alone
        self._snapshots: dict[float, tuple[float, dict]] = {}  # window_s -> (made at, snapshot)

    def record(self, *, model: str, session: str | None, turns: int, hashes: Sequence[int], prompt_tokens: int,
               output_tokens: int, traffic_class: str, engine: str, cached_tokens: int, duration_s: float) -> None:
        """One successful request that just ended after `duration_s` seconds."""
        owner = session if session else next(self._anonymous)
        within, cross = self._owners.classify(hashes, owner)  # hashes differ per model: no clash
        now = self.clock()
        self._requests.append((now - duration_s, now, model, session or "", turns, prompt_tokens,  # Finished's
                               output_tokens, len(hashes), within, cross, traffic_class, engine,  # order
                               cached_tokens))
        horizon = now - self.max_window_s
        ring = self._requests
        while ring[0][_END] < horizon:
            ring.popleft()

    def recent(self, window_s: float) -> list[tuple]:
        """The requests that ended in the last `window_s` seconds, oldest first (plain tuples in Finished's order)."""
        horizon = self.clock() - min(window_s, self.max_window_s)
        out = []
        for r in reversed(self._requests):
            if r[_END] < horizon:
                break
            out.append(r)
        out.reverse()
        return out

    def snapshot(self, window_s: float = 60.0) -> dict:
        """{"window_s", "models": {model or "*": profile}} over the requests that ended in the window."""
        window_s = min(window_s, self.max_window_s)
        now = self.clock()
        made = self._snapshots.get(window_s)
        if made is not None and now - made[0] < SNAPSHOT_TTL_S:
            return made[1]
        recent = self.recent(window_s)
        groups: dict[str, list[tuple]] = {ALL: recent}
        for r in recent:
            groups.setdefault(r[_MODEL], []).append(r)
        models = {}
        for name, rs in sorted(groups.items()):
            if name != ALL and len(rs) == len(recent):  # the one model: its profile is the overall one
                models[name] = models.get(ALL) or summarize(rs[::-(-len(rs) // SAMPLE) or 1], window_s, len(rs),
                                                            peak_concurrency(rs))
                continue
            models[name] = summarize(rs[::-(-len(rs) // SAMPLE) or 1], window_s, len(rs), peak_concurrency(rs))
        snap = {"window_s": window_s, "tracked_blocks": len(self._owners), "models": models}
        self._snapshots[window_s] = (now, snap)
        return snap


def peak_concurrency(requests: Sequence[tuple]) -> int:
    """The most of `requests` in flight at once (a request ending as another starts is not beside it). They are
    in order of their ends (the ring's), so one sort of the starts and one walk over both: at the j-th start,
    j + 1 have started and those ending by then have left. Only finished requests are seen. (A binary search per
    start took twice as long: 32 against 15 ms for 50,000 requests, and /metrics scrapes run it.)"""
    ends = [r[_END] for r in requests]
    gone, best, n = 0, 0, len(ends)
    for j, start in enumerate(sorted(r[_START] for r in requests)):
        while gone < n and ends[gone] <= start:
            gone += 1
        if j - gone >= best:
            best = j - gone + 1
    return best


def histogram(values: Iterable[int], bounds: Sequence[int]) -> dict:
    """Counts per bucket: `le[i]` is each bucket's upper bound (None: above the last bound)."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    return {"le": [*bounds, None], "counts": counts}


def _quantiles(values: list[int]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return {"mean": round(sum(s) / len(s), 1), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(requests: Sequence[tuple], window_s: float, total: int, peak: int | None = None) -> dict:
    """The profile of `requests` (Finished's fields), a sample (every k-th) of the `total` that ended in the
    window; `peak`: the window's peak concurrency over every request (None: the sample's own)."""
    requests = [Finished._make(r) for r in requests]  # at most SAMPLE of them
    n = len(requests)
    blocks = sum(r.blocks for r in requests)
    within = sum(r.within_session for r in requests)
    cross = sum(r.cross_session for r in requests)
    sessions: dict[str, int] = {}
    for r in requests:
        if r.session:
            sessions[r.session] = max(sessions.get(r.session, 0), r.turns)
    lengths = list(sessions.values()) + [r.turns for r in requests if not r.session]
    classes: dict[str, int] = {}
    engines: dict[str, list[int]] = {}
    for r in requests:
        classes[r.traffic_class] = classes.get(r.traffic_class, 0) + 1
        e = engines.setdefault(r.engine or "none", [0, 0, 0])
        e[0] += 1
        e[1] += r.cached_tokens
        e[2] += r.prompt_tokens
    busy = sum(r.end - r.start for r in requests) * (total / n if n else 0)  # a request's whole span
    share = lambda part: round(part / blocks, 4) if blocks else None
    prompts = [r.prompt_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    return {
        "requests": total,
        "sampled": n,
        "arrival_rps": round(total / window_s, 4),
        "concurrency_mean": round(busy / window_s, 3),
        "concurrency_peak": peak_concurrency(requests) if peak is None else peak,
        "prefix_repetition": {"blocks": blocks, "any": share(within + cross), "within_session": share(within),
                              "cross_session": share(cross)},
        "prompt_tokens": {**_quantiles(prompts), "histogram": histogram(prompts, PROMPT_BOUNDS)},
        "output_tokens": {**_quantiles(outputs), "histogram": histogram(outputs, OUTPUT_BOUNDS)},
        "session_turns": {"sessions": len(sessions), **_quantiles(lengths),
                          "histogram": histogram(lengths, TURN_BOUNDS)},
        "classes": {c: round(k / n, 4) for c, k in sorted(classes.items())},
        "engines": {e: {"requests": k, "share": round(k / n, 4),
                        "hit_rate": round(cached / prompt, 4) if prompt else None}
                    for e, (k, cached, prompt) in sorted(engines.items())},
    }
