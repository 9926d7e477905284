"""duet/registry.py against a real redis-server: the entry a worker heartbeats is the one the gateway's
RedisStore lists, it expires without heartbeats, `stop()` removes it at once, and a Redis outage never
raises into the worker."""

from __future__ import annotations

import asyncio

import pytest

from duet.registry import Registration, advertised_address, worker_info, worker_key
from gateway.control.state.redis_store import RedisStore

INFO = worker_info("w-reg", "10.1.2.3:7001", "prefix", "tiny", "v2")


async def test_the_gateway_store_lists_what_a_registration_writes_and_stop_removes_it(clean_redis_url):
    store = RedisStore(clean_redis_url)
    reg = Registration(clean_redis_url, INFO, ttl_s=0.6)
    try:
        reg.start()
        await asyncio.sleep(0.1)
        assert await store.list_workers() == [INFO]
        await asyncio.sleep(1.0)  # longer than the TTL: the heartbeats keep it alive
        assert await store.list_workers() == [INFO]
        await reg.stop()
        assert await store.list_workers() == []
    finally:
        await store.close()


async def test_an_entry_without_heartbeats_expires(clean_redis_url):
    reg = Registration(clean_redis_url, INFO, ttl_s=0.3)
    assert await reg.beat()
    store = RedisStore(clean_redis_url)
    try:
        assert [w["worker_id"] for w in await store.list_workers()] == ["w-reg"]
        await asyncio.sleep(0.5)
        assert await store.list_workers() == []
    finally:
        await store.close()
        await reg.stop()


async def test_redis_down_is_survived_and_bad_input_is_refused():
    reg = Registration("redis://127.0.0.1:1", INFO, ttl_s=1.0)  # nothing listens on port 1
    assert await reg.beat() is False
    await reg.stop()  # logs, does not raise
    with pytest.raises(ValueError, match="worker_id"):
        Registration("redis://127.0.0.1:1", {"address": "a:1"})
    assert worker_key("w") == "duet:worker:w"
    assert advertised_address("10.0.0.5", 7001) == "10.0.0.5:7001"
    assert not advertised_address("0.0.0.0", 7001).startswith("0.0.0.0")
