"""Limits per API key, shared by every gateway replica through Redis (in-process without Redis).

Per key (config: `auth.api_keys` entries, `auth.default_key_limits`; docs/operations.md):

    requests_per_minute   requests accepted per minute window
    tokens_per_minute     prompt tokens + max_tokens × n accepted per minute window (counted up front,
                          as OpenAI does: a request's whole budget is known before it runs)
    max_concurrent        requests of the key in flight at once (streams included)
    models                the models the key may use (others answer 404 model_not_found, as OpenAI)
    band                  its priority band under overload (BANDS: critical, standard, sheddable; flow
                          control in gateway/serving/admission.py reads it, nothing here counts it)

`KeyLimiter.acquire` checks all of them in one Redis round trip (a Lua script, so replicas never race)
and returns a `Lease`; releasing it (the `LeaseMiddleware`, when the response's last byte is sent)
frees the concurrency slot. Concurrency slots are members of a sorted set scored by a lease expiry
that a background task renews while the request runs, so a gateway that dies holding slots gives
them back within `LEASE_S`. Windows are fixed minutes (keys expire on their own). A refused request
is a 429 `rate_limit_exceeded` with `Retry-After` (seconds to the next window; 1 for concurrency).

Redis being down must not take the API down: the limiter then answers from per-process counters
(each replica enforces the limits on its own traffic) and logs the outage once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

from gateway.errors import ModelNotFound, RateLimited
from gateway.ticks import sleep_to_tick

log = logging.getLogger("duet.gateway.limits")

WINDOW_S = 60
# Priority bands, highest first: how admission treats a key's requests once the engines' queue is long
# (gateway/serving/admission.py). A request may lower its own band with `x-duet-band`, never raise it.
CRITICAL, STANDARD, SHEDDABLE = BANDS = ("critical", "standard", "sheddable")
LEASE_S = 30.0  # a concurrency slot not renewed for this long is free again (its gateway died)

# KEYS: requests window, tokens window, concurrency set. ARGV: now (s), window ttl, rpm, tpm, conc,
# member, lease expiry, tokens. Returns 0 (accepted) or which limit refused: 1 rpm, 2 tpm, 3 concurrency.
_ACQUIRE_LUA = """
local rpm, tpm, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens = tonumber(ARGV[8])
if rpm > 0 and tonumber(redis.call('GET', KEYS[1]) or '0') >= rpm then return 1 end
if tpm > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + tokens > tpm then return 2 end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[1])
  if redis.call('ZCARD', KEYS[3]) >= conc then return 3 end
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('INCRBY', KEYS[2], tokens); redis.call('EXPIRE', KEYS[2], ARGV[2])
return 0
"""


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    models: tuple[str, ...] | None = None  # None: every model
    band: str = STANDARD

    @classmethod
    def from_dict(cls, d: dict, where: str) -> KeyLimits:
        out = {}
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = d.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}.{name} must be a positive integer, got {value!r}")
            out[name] = value
        models = d.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ValueError(f"{where}.models must be a list of model names, got {models!r}")
        band = d.get("band") or STANDARD
        if band not in BANDS:
            raise ValueError(f"{where}.band must be one of {', '.join(BANDS)}, got {band!r}")
        return cls(models=tuple(models) if models is not None else None, band=band, **out)

    @property
    def counted(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))


def api_key_id(key: str | bytes) -> str:
    """What identifies a key in logs, metrics and Redis (never the key itself)."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()[:12]


def parse_key_limits(entries, default: dict | None) -> dict[str, KeyLimits]:
    """`auth.api_keys` entries (strings or {key, cache_salt, <limits>}) -> key id -> KeyLimits."""
    base = KeyLimits.from_dict(default or {}, "auth.default_key_limits")
    out = {}
    for e in entries or ():
        key = e if isinstance(e, str) else e.get("key") if isinstance(e, dict) else None
        if not isinstance(key, str):
            continue  # parse_api_keys reports it
        own = {k: v for k, v in e.items() if k not in ("key", "cache_salt")} if isinstance(e, dict) else {}
        merged = {**{k: getattr(base, k) for k in ("requests_per_minute", "tokens_per_minute", "max_concurrent",
                                                   "band")},
                  "models": list(base.models) if base.models is not None else None, **own}
        out[api_key_id(key)] = KeyLimits.from_dict(merged, "auth.api_keys[].limits")
    return out


@dataclass
class Lease:
    key_id: str
    member: str
    holds_slot: bool
    released: bool = False


class _LocalCounters:
    """The same checks on this process's traffic only (no Redis, or Redis down)."""

    def __init__(self) -> None:
        self.windows: dict[tuple[str, str, int], int] = defaultdict(int)
        self.slots: dict[str, set[str]] = defaultdict(set)

    def acquire(self, key_id: str, lim: KeyLimits, window: int, member: str, tokens: int) -> int:
        reqs, toks = self.windows[(key_id, "req", window)], self.windows[(key_id, "tok", window)]
        if lim.requests_per_minute and reqs >= lim.requests_per_minute:
            return 1
        if lim.tokens_per_minute and toks + tokens > lim.tokens_per_minute:
            return 2
        if lim.max_concurrent:
            if len(self.slots[key_id]) >= lim.max_concurrent:
                return 3
            self.slots[key_id].add(member)
        self.windows[(key_id, "req", window)] += 1
        self.windows[(key_id, "tok", window)] += tokens
        for k in [k for k in self.windows if k[2] < window - 1]:  # old windows
            del self.windows[k]
        return 0

    def release(self, key_id: str, member: str) -> None:
        self.slots[key_id].discard(member)


class KeyLimiter:
    def __init__(self, limits: dict[str, KeyLimits], redis_url: str | None = None, prefix: str = "duet",
                 clock=time.time) -> None:
        self.limits = limits
        self.clock = clock
        self._p = f"{prefix}:limit"
        self._local = _LocalCounters()
        self._live: dict[str, Lease] = {}  # member -> lease, renewed while it runs
        self._redis = None
        self._script = None
        self.redis_down = False
        if redis_url and any(lim.counted for lim in limits.values()):
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
            self._script = self._redis.register_script(_ACQUIRE_LUA)

    async def acquire(self, key_id: str | None, model: str, tokens: int) -> Lease | None:
        """Accept one request of `tokens` (prompt + max_tokens) for `model`, or raise ModelNotFound /
        RateLimited. None: the key has no counted limits (nothing to release)."""
        lim = self.limits.get(key_id) if key_id else None
        if lim is None:
            return None
        if lim.models is not None and model not in lim.models:
            raise ModelNotFound(model)
        if not lim.counted:
            return None
        now = self.clock()
        window = int(now // WINDOW_S)
        member = uuid.uuid4().hex
        refused = await self._acquire_shared(key_id, lim, now, window, member, tokens)
        if refused is None:  # Redis down: this replica's own counters
            refused = self._local.acquire(key_id, lim, window, member, tokens)
        if refused:
            retry = 1 if refused == 3 else max(1, math.ceil((window + 1) * WINDOW_S - now))
            what = {1: f"{lim.requests_per_minute} requests per minute",
                    2: f"{lim.tokens_per_minute} tokens per minute (this request counts {tokens}: prompt + max_tokens)",
                    3: f"{lim.max_concurrent} concurrent requests"}[refused]
            raise RateLimited(f"Rate limit reached for this API key: {what}. Retry after {retry} s.", retry)
        lease = Lease(key_id, member, holds_slot=lim.max_concurrent is not None)
        if lease.holds_slot:
            self._live[member] = lease
        return lease

    async def _acquire_shared(self, key_id, lim: KeyLimits, now, window, member, tokens) -> int | None:
        if self._redis is None:
            return None
        k = f"{self._p}:{key_id}"
        try:
            result = await self._script(
                keys=[f"{k}:req:{window}", f"{k}:tok:{window}", f"{k}:slots"],
                args=[now, WINDOW_S * 2, lim.requests_per_minute or 0, lim.tokens_per_minute or 0,
                      lim.max_concurrent or 0, member, now + LEASE_S, tokens])
        except Exception as e:  # noqa: BLE001 - any Redis failure: fall back, never fail the request
            if not self.redis_down:
                log.warning("rate limits: Redis unavailable (%s); enforcing per replica until it is back", e)
            self.redis_down = True
            return None
        if self.redis_down:
            log.warning("rate limits: Redis is back; limits are shared again")
            self.redis_down = False
        return int(result)

    async def release(self, lease: Lease | None) -> None:
        if lease is None or lease.released:
            return
        lease.released = True
        if not lease.holds_slot:
            return
        self._live.pop(lease.member, None)
        self._local.release(lease.key_id, lease.member)
        if self._redis is not None:
            with contextlib.suppress(Exception):  # an expired lease frees the slot anyway
                await self._redis.zrem(f"{self._p}:{lease.key_id}:slots", lease.member)

    async def renew_leases(self) -> None:
        """Push the expiry of every running request's slot forward (the background task's tick)."""
        if self._redis is None or not self._live:
            return
        expiry = self.clock() + LEASE_S
        with contextlib.suppress(Exception):
            async with self._redis.pipeline(transaction=False) as pipe:
                for lease in list(self._live.values()):
                    pipe.zadd(f"{self._p}:{lease.key_id}:slots", {lease.member: expiry}, xx=True)
                await pipe.execute()

    async def run(self) -> None:
        while True:
            await sleep_to_tick(LEASE_S / 3)
            await self.renew_leases()

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


class LeaseMiddleware:
    """Releases the request's key lease (`scope["state"]["key_lease"]`) once the response is done,
    however it ended: complete, error, client gone. Streams are done when their last byte is sent."""

    def __init__(self, app, limiter: KeyLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            lease = scope.get("state", {}).get("key_lease")
            if lease is not None:
                await self.limiter.release(lease)
