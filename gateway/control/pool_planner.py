"""The pool planner: how many workers of each engine kind the traffic calls for. Pure (the caller
passes the clock and the measurements), so it is tested without I/O.

Work routed to a kind, in prefill-token equivalents per second:

    work = uncached prefill tokens/s + decode_token_cost * decode tokens/s + queued prefill tokens / drain_s

(an uncached prompt token and a generated token cost the engine different amounts: one decode token
is about `decode_token_cost` prefill tokens of a worker's time; a backlog of queued prefill should be
worked off within `drain_s`). The balanced split gives each kind workers in proportion to its work,
at least one to a kind that has traffic, none to a kind without (while the other has some).

Hysteresis, so it never flaps: the target moves only when the balanced split differs from it by more
than `hysteresis` workers for one kind (a share of 2.6 against a target of 2 is not enough at 0.75:
it must pass 2.75 or fall below 1.25), and never twice within `cooldown_s`. Rates are averaged over
`window_s`; with no traffic at all the target stays where it is.

Zero workers of a kind is a valid split: a kind that had no traffic over the window gives all its
workers up, so the planner can settle on a homogeneous fleet when that is what the traffic calls for
(routing sends everything to the kind there is). Traffic of a kind is the work routing WANTED for it
(gateway/control/pool_tracker.py). One exception keeps a kind alive without work: a request needing a
capability only that kind has (n > 1 or beam search: engine_paged; structured output or speculative
decoding: engine_prefix). The caller passes those kinds as `needed`; each keeps at least one worker
while such requests arrive, and a needed kind with no worker gets one at once, cooldown or not (until
then those requests get a 503 that names the kind serving them).

A fleet that changes size (a worker switching kind leaves and comes back; one restarts, is added or is
lost) moves as few workers as it takes: a shrink takes from the kind furthest above its share (never the
last worker of a kind with traffic), a grow gives to the kind furthest below it, and the size the fleet
had before is remembered, so a worker coming back restores the target it left. Recomputing the split
from the work of the moment instead (as the first version did) reset the target twice per switch,
skipping hysteresis and cooldown, and made the planner flap in `duet bench compare`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

KINDS = ("paged", "prefix")
_NEEDED_WORK = 1e-6  # a needed kind without work weighs next to nothing: it gets one worker, no more


@dataclass(frozen=True)
class PlannerConfig:
    decode_token_cost: float = 4.0  # one decode token costs the engine this many uncached prefill tokens
    drain_s: float = 10.0  # a prefill backlog should be worked off within this long
    hysteresis: float = 0.75  # workers the balanced share must move past the target before it changes
    cooldown_s: float = 30.0  # at least this long between two changes of the target
    window_s: float = 30.0  # rates are averaged over this window

    def validate(self) -> PlannerConfig:
        if self.decode_token_cost < 0 or self.drain_s <= 0 or self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("decode_token_cost >= 0, drain_s > 0, window_s > 0, cooldown_s >= 0 required")
        if not 0.5 <= self.hysteresis < 2:
            raise ValueError(f"hysteresis must be in [0.5, 2) workers, got {self.hysteresis}")
        return self


@dataclass
class WorkMeter:
    """Per-kind work over a sliding window: events are (time, prefill tokens, decode tokens)."""

    window_s: float = 30.0
    events: dict[str, deque] = field(default_factory=lambda: {k: deque() for k in KINDS})
    started_at: float | None = None

    def record(self, kind: str, now: float, prefill_tokens: int, decode_tokens: int) -> None:
        if kind not in self.events:
            return
        if self.started_at is None:
            self.started_at = now
        self.events[kind].append((now, max(0, prefill_tokens), max(0, decode_tokens)))

    def rates(self, now: float) -> dict[str, tuple[float, float]]:
        """kind -> (uncached prefill tokens/s, decode tokens/s) over the window (or since the first
        event, if that is shorter: a new gateway is not diluted by time it was not measuring)."""
        span = self.window_s if self.started_at is None else max(1.0, min(self.window_s, now - self.started_at))
        out = {}
        for kind, q in self.events.items():
            while q and q[0][0] < now - self.window_s:
                q.popleft()
            out[kind] = (sum(e[1] for e in q) / span, sum(e[2] for e in q) / span)
        return out


def kind_work(prefill_tps: float, decode_tps: float, queued_prefill_tokens: float, config: PlannerConfig) -> float:
    """One kind's work in prefill-token equivalents per second (module docstring)."""
    return prefill_tps + config.decode_token_cost * decode_tps + queued_prefill_tokens / config.drain_s


def balanced_shares(work: dict[str, float], total: int) -> dict[str, float]:
    """Each kind's fractional share of `total` workers, proportional to its work (all zero: none)."""
    s = sum(work.values())
    return {k: (total * work[k] / s if s > 0 else 0.0) for k in KINDS}


def resized(target: dict[str, int], total: int, work: dict[str, float]) -> dict[str, int]:
    """`target` grown or shrunk to `total` workers one worker at a time (module docstring)."""
    out = {k: target.get(k, 0) for k in KINDS}
    shares = balanced_shares(work, total)
    while sum(out.values()) > total:
        spare = [k for k in KINDS if out[k] > (1 if work.get(k, 0.0) > 0 else 0)] or [k for k in KINDS if out[k]]
        k = max(spare, key=lambda k: out[k] - shares[k])
        out[k] -= 1
    while sum(out.values()) < total:
        k = max(KINDS, key=lambda k: shares[k] - out[k])
        out[k] += 1
    return out


def balanced_split(work: dict[str, float], total: int, needed: frozenset[str] = frozenset()) -> dict[str, int] | None:
    """Whole workers per kind, in proportion to the work: at least one for a kind with work or in
    `needed` (when `total` >= 2), none for a kind without either. None when there is no work at all."""
    if total < 1:
        raise ValueError(f"total workers must be >= 1, got {total}")
    work = {k: max(work.get(k, 0.0), _NEEDED_WORK if k in needed else 0.0) for k in KINDS}
    busy = [k for k in KINDS if work.get(k, 0.0) > 0]
    if not busy:
        return None
    if len(busy) == 1 or total == 1:
        top = max(KINDS, key=lambda k: work.get(k, 0.0))
        return {k: (total if k == top else 0) for k in KINDS}
    shares = balanced_shares(work, total)
    paged = min(total - 1, max(1, round(shares["paged"])))
    return {"paged": paged, "prefix": total - paged}


@dataclass
class PoolPlanner:
    """The target split with hysteresis and a cooldown (module docstring). Call `update` each tick."""

    config: PlannerConfig = field(default_factory=PlannerConfig)
    total: int = 0
    target: dict[str, int] | None = None
    changed_at: float | None = None
    last_work: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})
    changes: int = 0
    before_resize: dict[str, int] | None = None  # the target when the fleet last changed size

    def update(self, now: float, work: dict[str, float], current: dict[str, int], hold: bool = False,
               needed: frozenset[str] = frozenset()) -> dict[str, int]:
        """The target after this tick. `current`: workers of each kind now (their sum is the fleet
        size; the first target is the current split). `hold`: keep the target (the measurements do not
        yet cover a whole window). `needed`: kinds a recent request could only be served by."""
        self.last_work = {k: max(work.get(k, 0.0), _NEEDED_WORK if k in needed else 0.0) for k in KINDS}
        total = sum(current.get(k, 0) for k in KINDS)
        if total < 1:
            return dict(self.target or {k: 0 for k in KINDS})
        self.total = total
        if self.target is None or (hold and sum(self.target.values()) != total):
            self.target = {k: current.get(k, 0) for k in KINDS}
        if hold:
            return dict(self.target)
        if sum(self.target.values()) != total:  # the fleet changed size: move as few workers as it takes
            previous, self.before_resize = self.before_resize, dict(self.target)
            if previous is not None and sum(previous.values()) == total:
                # the worker came back (a kind switch, a restart): the target it left
                self.target, self.before_resize = previous, None
            else:
                self.target = resized(self.target, total, self.last_work)
            return dict(self.target)
        wanted = balanced_split(self.last_work, self.total)
        if wanted is None or wanted == self.target:
            return dict(self.target)
        unservable = any(self.target[k] == 0 and wanted[k] > 0 for k in needed)
        if not unservable and self.changed_at is not None and now - self.changed_at < self.config.cooldown_s:
            return dict(self.target)
        shares = balanced_shares(self.last_work, self.total)
        starved = any(self.last_work[k] > 0 and self.target[k] == 0 for k in KINDS)
        idle = any(self.last_work[k] == 0 and self.target[k] > 0 for k in KINDS)
        far = any(abs(shares[k] - self.target[k]) > self.config.hysteresis for k in KINDS)
        if starved or idle or far:
            self.target, self.changed_at = wanted, now
            self.changes += 1
        return dict(self.target)

    def report(self, current: dict[str, int], rates: dict[str, tuple[float, float]] | None = None) -> dict:
        """What `GET /admin/pools` returns (`target` is what an orchestrator acts on)."""
        target = self.target or {k: current.get(k, 0) for k in KINDS}
        self.total = self.total or sum(target.values())
        out = {
            "target": dict(target),
            "current": {k: current.get(k, 0) for k in KINDS},
            "total": self.total,
            "work": {k: round(v, 1) for k, v in self.last_work.items()},
            "balanced_share": {k: round(v, 2) for k, v in balanced_shares(self.last_work, self.total).items()},
            "changes": self.changes,
        }
        if rates is not None:
            out["rates"] = {k: {"prefill_tokens_per_s": round(p, 1), "decode_tokens_per_s": round(d, 1)}
                            for k, (p, d) in rates.items()}
        return out
