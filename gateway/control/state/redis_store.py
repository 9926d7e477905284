"""StateStore on Redis (redis-py asyncio), shared by every gateway replica.

Keys (under `prefix`, default "duet"):
  {p}:aff:{key}       session/user key -> worker id, with a TTL (SET PX; refreshed on use)
  {p}:routing         hash: model -> routing config JSON (gateway/control/state/codec.py)
  {p}:routing:changed pub/sub channel: a model name each time its config changes
  {p}:worker:{id}     worker registration JSON, a TTL key renewed by heartbeats (duet/registry.py)
  {p}:audit           capped list (LPUSH + LTRIM) of config changes, newest first
  {p}:capture:salt    the deployment's capture salt (SET NX: the first replica's wins), never exported
  {p}:capture         capped list (RPUSH + LTRIM) of captured trace records, oldest first

Every replica keeps a local copy of all routing configs, loaded at start and kept current by
a background task subscribed to the channel, so `get_routing` costs no round trip and a
change reaches every replica within one message delivery (well under a second).

When Redis goes away: reads answer from the local copies (configs, the affinities this
replica saw, the last worker list), `healthy` turns False, the outage is logged once,
`redis_errors_total` counts the failed calls, and request-path calls stop touching Redis
until the background task reconnects. On reconnect it re-subscribes, reloads every config
(announcing the ones that changed meanwhile; configs Redis lost, e.g. a restart without
persistence, are written back from the local copy) and turns `healthy` back on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from duet.registry import worker_key, worker_key_pattern
from gateway.control.state import StateUnavailable
from gateway.control.state.codec import config_from_json, config_to_dict, config_to_json
from gateway.routing.route_types import RoutingConfig, RoutingConfigError

log = logging.getLogger("duet.gateway.state")

T = TypeVar("T")
_OUTAGE = (RedisConnectionError, RedisTimeoutError, OSError)


class _Down(Exception):
    """Internal: Redis is (or just went) unreachable; answer from local state."""


class RedisStore:
    def __init__(
        self,
        url: str,
        prefix: str = "duet",
        audit_capacity: int = 1000,
        socket_timeout_s: float = 1.0,
        retry_interval_s: float = 0.25,
        local_affinity_capacity: int = 100_000,
    ) -> None:
        self.healthy = False  # until the first successful load
        self.redis_errors_total = 0
        self.url = url
        self._p = prefix
        self._channel = f"{prefix}:routing:changed"
        self._audit_capacity = audit_capacity
        self._retry_interval_s = retry_interval_s
        # no client-side retries: an outage must surface at once, the background task retries
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True,
        )
        self._routing: dict[str, RoutingConfig] = {}
        self._affinity: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._affinity_capacity = local_affinity_capacity
        self._workers: list[dict[str, Any]] = []
        self._audit: list[dict[str, Any]] = []
        self._watchers: set[asyncio.Queue[str]] = set()
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self._outage_logged = False

    # lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every config and start the change subscriber. Called by the first use."""
        if self._started:
            return
        self._started = True
        try:
            await self._reload_routing()
            self._mark_up()
        except _OUTAGE as e:
            self._mark_down(e)
        self._task = asyncio.create_task(self._subscriber(), name="duet-redis-subscriber")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await self._task
        self._watchers.clear()
        await self._redis.aclose()

    def _mark_down(self, err: BaseException) -> None:
        self.redis_errors_total += 1
        self.healthy = False
        if not self._outage_logged:  # once per outage
            log.warning("Redis at %s unreachable (%s); serving last known state", self.url, err)
            self._outage_logged = True

    def _mark_up(self) -> None:
        if self._outage_logged:
            log.warning("Redis at %s reachable again; state resynchronized", self.url)
            self._outage_logged = False
        self.healthy = True

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call; raise _Down (and record the outage) if Redis is unreachable."""
        if not self._started:
            await self.start()
        if not self.healthy:
            raise _Down
        try:
            return await fn()
        except _OUTAGE as e:
            self._mark_down(e)
            raise _Down from None

    # change feed ---------------------------------------------------------------------------

    async def _subscriber(self) -> None:
        while not self._closed:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                # reload after subscribing: no change can fall between the two
                await self._reload_routing()
                self._mark_up()
                while not self._closed:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None:
                        await self._refresh_model(str(msg["data"]))
                    elif not self.healthy:  # a request-path call failed; the channel is fine
                        await self._redis.ping()
                        await self._reload_routing()
                        self._mark_up()
            except asyncio.CancelledError:
                raise
            except _OUTAGE as e:
                self._mark_down(e)
                await asyncio.sleep(self._retry_interval_s)
            finally:
                with contextlib.suppress(RedisError, OSError):  # the connection may be gone
                    await pubsub.aclose()

    def _parse(self, model: str, raw: str) -> RoutingConfig | None:
        try:
            return config_from_json(raw)
        except RoutingConfigError as e:
            log.error("ignoring invalid routing config for %r in Redis: %s", model, e)
            return self._routing.get(model)

    async def _reload_routing(self) -> None:
        key = f"{self._p}:routing"
        raw = await self._redis.hgetall(key)
        lost = [m for m in self._routing if m not in raw]
        if lost:
            # Redis came back without our configs (restarted without persistence): re-seed
            # it from the last known state; HSETNX never overwrites another replica's write
            log.warning("Redis lost routing configs for %s; restoring the last known ones", lost)
            for m in lost:
                await self._redis.hsetnx(key, m, config_to_json(self._routing[m]))
            raw = await self._redis.hgetall(key)
        fresh = {m: c for m, text in raw.items() if (c := self._parse(m, text)) is not None}
        changed = {m for m in fresh.keys() | self._routing.keys() if fresh.get(m) != self._routing.get(m)}
        self._routing = fresh
        self._notify(changed)

    async def _refresh_model(self, model: str) -> None:
        raw = await self._redis.hget(f"{self._p}:routing", model)
        config = self._parse(model, raw) if raw is not None else None
        if config != self._routing.get(model):
            if config is None:
                self._routing.pop(model, None)
            else:
                self._routing[model] = config
            self._notify({model})

    def _notify(self, models: set[str]) -> None:
        for m in sorted(models):
            for q in self._watchers:
                q.put_nowait(m)

    async def watch_routing(self) -> AsyncIterator[str]:
        if not self._started:
            await self.start()
        q: asyncio.Queue[str] = asyncio.Queue()
        self._watchers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._watchers.discard(q)

    # routing configs -----------------------------------------------------------------------

    async def get_routing(self, model: str) -> RoutingConfig | None:
        if not self._started:
            await self.start()
        return self._routing.get(model)

    async def put_routing(self, model: str, config: RoutingConfig, actor: str) -> None:
        config.validate()
        key = f"{self._p}:routing"

        async def write() -> None:
            before_raw = await self._redis.hget(key, model)
            entry = {
                "time": time.time(),
                "actor": actor,
                "model": model,
                "before": json.loads(before_raw) if before_raw is not None else None,
                "after": config_to_dict(config),
            }
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, model, config_to_json(config))
                pipe.lpush(f"{self._p}:audit", json.dumps(entry))
                pipe.ltrim(f"{self._p}:audit", 0, self._audit_capacity - 1)
                pipe.publish(self._channel, model)
                await pipe.execute()

        try:
            await self._call(write)
        except _Down:
            raise StateUnavailable(
                f"Redis at {self.url} is unreachable: the routing change for {model!r} was not applied"
            ) from None
        if self._routing.get(model) != config:
            self._routing[model] = config
            self._notify({model})

    # affinity ------------------------------------------------------------------------------

    def _remember_affinity(self, key: str, worker_id: str, expires: float) -> None:
        self._affinity[key] = (worker_id, expires)
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_capacity:
            self._affinity.popitem(last=False)

    async def get_affinity(self, key: str) -> str | None:
        async def fetch() -> tuple[str | None, int]:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.get(f"{self._p}:aff:{key}")
                pipe.pttl(f"{self._p}:aff:{key}")
                worker, ttl_ms = await pipe.execute()
            return worker, ttl_ms

        try:
            worker, ttl_ms = await self._call(fetch)
        except _Down:
            entry = self._affinity.get(key)
            return entry[0] if entry is not None and entry[1] > time.monotonic() else None
        if worker is None:
            self._affinity.pop(key, None)
        elif ttl_ms > 0:  # remember what other replicas set, for an outage
            self._remember_affinity(key, worker, time.monotonic() + ttl_ms / 1000.0)
        return worker

    async def set_affinity(self, key: str, worker_id: str, ttl_s: float) -> None:
        self._remember_affinity(key, worker_id, time.monotonic() + ttl_s)
        ttl_ms = max(1, int(ttl_s * 1000))
        try:
            await self._call(lambda: self._redis.set(f"{self._p}:aff:{key}", worker_id, px=ttl_ms))
        except _Down:
            pass  # kept locally; this replica still honours it

    # worker registry -----------------------------------------------------------------------

    async def register_worker(self, info: dict[str, Any], ttl_s: float) -> None:
        if "worker_id" not in info:
            raise ValueError("worker info needs a 'worker_id'")
        key = worker_key(str(info["worker_id"]), self._p)
        ttl_ms = max(1, int(ttl_s * 1000))
        try:
            await self._call(lambda: self._redis.set(key, json.dumps(info), px=ttl_ms))
        except _Down:
            others = [w for w in self._workers if w.get("worker_id") != info["worker_id"]]
            self._workers = [*others, dict(info)]

    async def list_workers(self) -> list[dict[str, Any]]:
        async def fetch() -> list[dict[str, Any]]:
            keys = [k async for k in self._redis.scan_iter(match=worker_key_pattern(self._p), count=500)]
            values = await self._redis.mget(keys) if keys else []
            return [json.loads(v) for v in values if v is not None]  # None: expired meanwhile

        try:
            self._workers = await self._call(fetch)
        except _Down:
            pass
        return [dict(w) for w in self._workers]

    # documents (stored responses) -----------------------------------------------------------

    async def put_document(self, kind: str, doc_id: str, doc: dict[str, Any], ttl_s: float) -> None:
        ttl_ms = max(1, int(ttl_s * 1000))
        await self._document_call(lambda: self._redis.set(f"{self._p}:doc:{kind}:{doc_id}", json.dumps(doc),
                                                          px=ttl_ms))

    async def get_document(self, kind: str, doc_id: str) -> dict[str, Any] | None:
        raw = await self._document_call(lambda: self._redis.get(f"{self._p}:doc:{kind}:{doc_id}"))
        return None if raw is None else json.loads(raw)

    async def delete_document(self, kind: str, doc_id: str) -> bool:
        return bool(await self._document_call(lambda: self._redis.delete(f"{self._p}:doc:{kind}:{doc_id}")))

    async def _document_call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await self._shared_call(fn, "stored responses are unavailable")

    # traffic capture (gateway/control/capture.py) -------------------------------------------

    async def capture_salt(self) -> str:
        key = f"{self._p}:capture:salt"

        async def fetch() -> str:
            await self._redis.set(key, secrets.token_hex(16), nx=True)  # every replica reads the first one's
            return await self._redis.get(key)

        return await self._shared_call(fetch, "the capture salt cannot be read")

    async def append_capture(self, lines: list[str], max_records: int) -> None:
        key = f"{self._p}:capture"

        async def push() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, *lines)
                pipe.ltrim(key, -max_records, -1)
                await pipe.execute()

        await self._shared_call(push, "captured records cannot be shared")

    async def capture_lines(self) -> list[str]:
        return await self._shared_call(lambda: self._redis.lrange(f"{self._p}:capture", 0, -1), "the capture cannot be read")

    async def _shared_call(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        try:
            return await self._call(fn)
        except _Down:
            raise StateUnavailable(f"Redis at {self.url} is unreachable: {what}") from None

    # audit ---------------------------------------------------------------------------------

    async def audit_log(self, limit: int = 100) -> list[dict[str, Any]]:
        try:
            raw = await self._call(lambda: self._redis.lrange(f"{self._p}:audit", 0, limit - 1))
            self._audit = [json.loads(r) for r in raw]
        except _Down:
            pass
        return self._audit[:limit]
