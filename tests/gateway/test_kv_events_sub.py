"""The ZMQ subscriber of an external backend's KV events (gateway/backends/kv_events_sub.py) against real ZMQ
sockets: a PUB and a ROUTER speaking vLLM's publisher protocol (topic, 8-byte seq, msgpack batch;
replay: `(b"", start_seq)` in, buffered batches and an end marker out)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgpack
import zmq
import zmq.asyncio

from duet.hashing import block_hashes
from duet.launcher import free_port
from duet.rpc import engine_pb2 as pb
from gateway.backends.backend_spec import KvEventsSpec
from gateway.backends.kv_events_decode import KvRehasher
from gateway.backends.kv_events_sub import KvEventSubscriber

MODEL = "m"
TOKENS = list(range(1, 257))
END = (-1).to_bytes(8, "big", signed=True)


def stored(h: int, parent: int | None, tokens: list[int]) -> bytes:
    return msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                                 "token_ids": tokens, "block_size": len(tokens)}]])


class Publisher:
    def __init__(self, replay: bool) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.router = None
        self.replay_endpoint = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.router.bind(self.replay_endpoint)
            self.task = asyncio.ensure_future(self._serve_replay())

    async def send(self, seq: int, payload: bytes, deliver: bool = True) -> None:
        self.buffer.append((seq, payload))
        if deliver:  # deliver=False: the batch is "lost" on the way (a gap), but kept for replay
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        if self.router is not None:
            self.task.cancel()
        self.ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def following(replay: bool):
    pub = Publisher(replay)
    sub = KvEventSubscriber(KvEventsSpec(pub.endpoint, pub.replay_endpoint, "kv"), KvRehasher(MODEL, 16), "b")
    got: asyncio.Queue = asyncio.Queue()

    async def follow():
        async for batch in sub.batches():
            got.put_nowait(batch)
        got.put_nowait(None)

    task = asyncio.ensure_future(follow())
    await asyncio.sleep(0.5)  # ZMQ's slow joiner: what is published before the SUB is connected is lost
    try:
        yield pub, sub, got
    finally:
        task.cancel()
        pub.close()


async def next_batch(got: asyncio.Queue) -> pb.KvEventBatch:
    return await asyncio.wait_for(got.get(), 10)


async def test_in_order_batches_are_stored():
    async with following(replay=False) as (pub, _, got):
        await pub.send(0, stored(1, None, TOKENS[:128]))
        await pub.send(1, stored(2, 1, TOKENS[128:]))
        hashes = [h for _ in range(2) for h in (await next_batch(got)).events[0].block_hashes]
        assert hashes == block_hashes(TOKENS, 16, MODEL)


async def test_a_gap_without_replay_drops_the_table():
    async with following(replay=False) as (pub, _, got):
        await pub.send(0, stored(1, None, TOKENS[:128]))
        await pub.send(1, stored(2, 1, TOKENS[128:]), deliver=False)
        await pub.send(2, stored(3, None, TOKENS[:64]))
        assert (await next_batch(got)).events[0].kind == pb.KvEvent.STORED
        gap = await next_batch(got)
        assert [e.kind for e in gap.events] == [pb.KvEvent.CLEARED]
        after = await next_batch(got)
        assert list(after.events[0].block_hashes) == block_hashes(TOKENS[:64], 16, MODEL)


async def test_a_gap_with_replay_is_filled():
    async with following(replay=True) as (pub, sub, got):
        await pub.send(0, stored(1, None, TOKENS[:128]))
        await pub.send(1, stored(2, 1, TOKENS[128:]), deliver=False)
        await pub.send(2, stored(3, None, TOKENS[:64]))
        batches = [await next_batch(got) for _ in range(3)]
        assert [b.sequence for b in batches] == [0, 1, 2] and sub.replayed == 1
        assert all(e.kind == pb.KvEvent.STORED for b in batches for e in b.events)
        assert list(batches[1].events[0].block_hashes) == block_hashes(TOKENS, 16, MODEL)[8:]


async def test_a_restarted_publisher_clears():
    async with following(replay=False) as (pub, _, got):
        await pub.send(0, stored(1, None, TOKENS[:128]))
        await pub.send(1, stored(2, 1, TOKENS[128:]))
        await pub.send(0, stored(1, None, TOKENS[:128]))
        kinds = [[e.kind for e in (await next_batch(got)).events] for _ in range(4)]
        assert kinds[2] == [pb.KvEvent.CLEARED]


async def test_an_unknown_format_ends_the_subscriber_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, "duet.gateway.kv_events"):
        async with following(replay=False) as (pub, _, got):
            await pub.send(0, msgpack.packb({"version": 9}))
            assert await next_batch(got) is None
    assert [r.message for r in caplog.records if "unknown format" in r.message]
