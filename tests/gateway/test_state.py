"""The StateStore contract, run on both implementations, plus what only Redis can show:
two gateway replicas sharing one Redis, and a Redis outage."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.control.state import StateStore, StateUnavailable
from gateway.control.state.codec import config_from_dict, config_to_dict
from gateway.control.state.memory import MemoryStore
from gateway.control.state.redis_store import RedisStore
from gateway.routing.route_types import Pool, RoutingConfig, RoutingConfigError, Variant

CANARY = RoutingConfig(
    variants=(
        Variant("stable", (Pool("paged", "v1"), Pool("prefix", "v1")), 0.9),
        Variant("canary", (Pool("prefix", "v2"),), 0.1),
    ),
    reuse_threshold=0.4,
)


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryStore()
    else:
        s = RedisStore(request.getfixturevalue("clean_redis_url"))
    yield s
    await s.close()


async def next_change(it, timeout: float = 1.0) -> str:
    return await asyncio.wait_for(it.__anext__(), timeout)


async def test_both_stores_satisfy_the_protocol(store):
    assert isinstance(store, StateStore)


async def test_affinity_roundtrip_and_ttl(store):
    assert await store.get_affinity("sess-1") is None
    await store.set_affinity("sess-1", "w3", ttl_s=1.0)
    assert await store.get_affinity("sess-1") == "w3"
    await asyncio.sleep(0.6)
    await store.set_affinity("sess-1", "w3", ttl_s=1.0)  # use refreshes the TTL
    await asyncio.sleep(0.6)
    assert await store.get_affinity("sess-1") == "w3"  # 1.2 s after the first set
    await asyncio.sleep(1.0)
    assert await store.get_affinity("sess-1") is None


async def test_routing_config_roundtrip_audit_and_change_feed(store):
    assert await store.get_routing("m") is None
    changes = store.watch_routing()
    pending = asyncio.ensure_future(next_change(changes))
    await asyncio.sleep(0.1)  # let the watcher subscribe
    await store.put_routing("m", RoutingConfig(), actor="key-admin")
    await store.put_routing("m", CANARY, actor="alice")
    assert await pending == "m"
    assert await store.get_routing("m") == CANARY
    log = await store.audit_log(limit=10)
    assert [e["actor"] for e in log] == ["alice", "key-admin"]  # newest first
    assert log[0]["model"] == "m"
    assert config_from_dict(log[0]["after"]) == CANARY
    assert config_from_dict(log[0]["before"]) == RoutingConfig()
    assert log[1]["before"] is None
    assert abs(log[0]["time"] - time.time()) < 60
    await changes.aclose()


async def test_invalid_routing_config_is_refused(store):
    with pytest.raises(RoutingConfigError, match="weight"):
        await store.put_routing("m", RoutingConfig(variants=(Variant("a", (Pool("paged"),), 0.0),)), "x")
    assert await store.get_routing("m") is None


async def test_worker_registry_heartbeats_expire(store):
    await store.register_worker({"worker_id": "w1", "address": "10.0.0.1:7001", "engine_kind": "paged"}, 1.0)
    await store.register_worker({"worker_id": "w2", "address": "10.0.0.2:7001", "engine_kind": "prefix"}, 30)
    assert {w["worker_id"] for w in await store.list_workers()} == {"w1", "w2"}
    await asyncio.sleep(0.6)
    await store.register_worker({"worker_id": "w1", "address": "10.0.0.1:7001", "engine_kind": "paged"}, 1.0)
    await asyncio.sleep(0.6)
    assert {w["worker_id"] for w in await store.list_workers()} == {"w1", "w2"}  # heartbeat kept it
    await asyncio.sleep(1.0)
    workers = await store.list_workers()
    assert [w["worker_id"] for w in workers] == ["w2"]
    assert workers[0]["address"] == "10.0.0.2:7001"


def test_config_codec_rejects_bad_input_clearly():
    assert config_from_dict(config_to_dict(CANARY)) == CANARY
    with pytest.raises(RoutingConfigError, match="unknown routing config keys: bogus"):
        config_from_dict({"bogus": 1})
    with pytest.raises(RoutingConfigError, match="reuse_threshold must be a float"):
        config_from_dict({"reuse_threshold": "high"})
    with pytest.raises(RoutingConfigError, match="unknown engine kind"):
        config_from_dict({"variants": [{"name": "a", "weight": 1, "pools": [{"engine_kind": "tgi"}]}]})


async def test_two_replicas_see_a_routing_change_within_one_second(clean_redis_url):
    a, b = RedisStore(clean_redis_url), RedisStore(clean_redis_url)
    try:
        await a.start()
        await b.start()
        changes = b.watch_routing()
        pending = asyncio.ensure_future(next_change(changes, timeout=1.0))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await a.put_routing("llama", CANARY, actor="ops")
        assert await pending == "llama"
        assert await b.get_routing("llama") == CANARY
        assert time.monotonic() - t0 < 1.0
        # affinity written by one replica is honoured by the other
        await a.set_affinity("sess-9", "w7", ttl_s=30)
        assert await b.get_affinity("sess-9") == "w7"
        await changes.aclose()
    finally:
        await a.close()
        await b.close()


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_redis_outage_serves_last_known_state_then_resyncs(private_redis):
    store = RedisStore(private_redis.url, retry_interval_s=0.1)
    try:
        await store.put_routing("llama", CANARY, actor="ops")
        await store.set_affinity("sess-1", "w2", ttl_s=60)
        peer = RedisStore(private_redis.url)  # another gateway replica
        await peer.set_affinity("sess-3", "w5", ttl_s=60)
        await peer.close()
        assert await store.get_affinity("sess-3") == "w5"
        assert store.healthy and store.redis_errors_total == 0

        private_redis.stop()
        await wait_for(lambda: not store.healthy)
        assert store.redis_errors_total >= 1
        # requests keep being routed on the last known state
        assert await store.get_routing("llama") == CANARY
        assert await store.get_affinity("sess-1") == "w2"
        assert await store.get_affinity("sess-3") == "w5"  # learnt from the peer's write
        await store.set_affinity("sess-2", "w1", ttl_s=60)
        assert await store.get_affinity("sess-2") == "w1"
        with pytest.raises(StateUnavailable, match="unreachable"):
            await store.put_routing("llama", RoutingConfig(), actor="ops")

        private_redis.start()  # same port, empty (no persistence)
        await wait_for(lambda: store.healthy)
        assert await store.get_routing("llama") == CANARY
        # resynchronized: re-subscribed, and the lost config was written back for other replicas
        other = RedisStore(private_redis.url)
        try:
            assert await other.get_routing("llama") == CANARY
            changes = store.watch_routing()
            pending = asyncio.ensure_future(next_change(changes, timeout=1.0))
            await asyncio.sleep(0.1)
            await other.put_routing("llama", RoutingConfig(reuse_threshold=0.7), actor="ops")
            assert await pending == "llama"
            assert (await store.get_routing("llama")).reuse_threshold == 0.7
            await changes.aclose()
        finally:
            await other.close()
    finally:
        await store.close()
