"""Worker self-registration in Redis: the one definition of the registry entry (no torch, no gateway).

A worker started with `--redis URL` keeps one key alive while it serves:

    {prefix}:worker:{worker_id}  ->  JSON {"worker_id", "address", "engine_kind", "model_id", "version"}
                                     SET with a TTL of `ttl_s`, rewritten every `ttl_s / 3` seconds

Gateways (gateway/control/state/redis_store.py) list the keys matching `worker_key_pattern()` and add every
entry's `address` to their pool; an entry whose heartbeats stop expires and its worker leaves the pools.
`Registration.stop()` deletes the key at once (drain, exit), so gateways stop routing to the worker
without waiting for the TTL. Redis being unreachable never stops a worker: the heartbeat logs the outage
once and keeps retrying; the entry reappears when Redis does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("duet.registry")

DEFAULT_PREFIX = "duet"
HEARTBEAT_TTL_S = 5.0


def worker_key(worker_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}:worker:{worker_id}"


def worker_key_pattern(prefix: str = DEFAULT_PREFIX) -> str:
    """The SCAN pattern matching every registered worker's key."""
    return worker_key("*", prefix)


def advertised_address(host: str, port: int) -> str:
    """The host:port gateways should dial: a wildcard bind address is no use to them, the host name is."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


def worker_info(worker_id: str, address: str, engine_kind: str, model_id: str, version: str) -> dict[str, Any]:
    """The registry entry's JSON fields (what the gateway reads)."""
    return {"worker_id": worker_id, "address": address, "engine_kind": engine_kind, "model_id": model_id,
            "version": version}


class Registration:
    """Heartbeats one worker's entry from `start()` until `stop()` (which deletes it).

    Both must be called on the same running event loop."""

    def __init__(self, redis_url: str, info: dict[str, Any], *, ttl_s: float = HEARTBEAT_TTL_S,
                 prefix: str = DEFAULT_PREFIX) -> None:
        if not info.get("worker_id") or not info.get("address"):
            raise ValueError("a worker registration needs a 'worker_id' and an 'address'")
        if ttl_s <= 0:
            raise ValueError("the registration TTL must be > 0 seconds")
        self.info = dict(info)
        self.key = worker_key(str(info["worker_id"]), prefix)
        self.ttl_s = ttl_s
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._task: asyncio.Task | None = None
        self._down = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._heartbeat())

    async def beat(self) -> bool:
        """Write the entry once; False (logged once per outage) when Redis is unreachable."""
        try:
            await self._redis.set(self.key, json.dumps(self.info), px=max(1, int(self.ttl_s * 1000)))
        except (RedisError, OSError) as e:
            if not self._down:
                log.warning("cannot register %s in Redis (will keep trying): %s", self.key, e)
            self._down = True
            return False
        if self._down:
            log.info("registered %s in Redis again", self.key)
        self._down = False
        return True

    async def _heartbeat(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.ttl_s / 3)

    async def stop(self) -> None:
        """Stop heartbeating and delete the entry (best effort), then close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self._redis.delete(self.key)
        except (RedisError, OSError) as e:
            log.warning("could not deregister %s (it expires in %.0f s): %s", self.key, self.ttl_s, e)
        await self._redis.aclose()
