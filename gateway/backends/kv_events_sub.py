"""One ZMQ subscriber per external backend: its KV-event batches as Duet `KvEventBatch`es.

The publisher (vLLM's `--kv-events-config`, SGLang's port of it) is a ZMQ PUB socket sending
three-part messages `(topic, 8-byte big-endian sequence number, msgpack batch)`, and optionally a
ROUTER "replay" socket: send it `(b"", start_seq)` and it streams back every buffered batch from that
sequence on as `(b"", topic, seq, payload)`, then `(b"", b"", -1, b"")`.

- Start: with a replay endpoint, everything the publisher still buffers is replayed first, so blocks
  cached before the gateway started are known; without one the index fills from new events only
  (blocks whose parent came earlier are skipped: gateway/backends/kv_events_decode.py).
- A sequence gap (a lost batch): replay the missing ones when a replay endpoint is configured;
  otherwise, or when the replay does not close the gap, a CLEARED event drops the worker's table,
  which then rebuilds from events — no stale hits.
- Sequence 0 again: the engine restarted with an empty cache: CLEARED too.
- A payload that is not a batch this decoder knows: one warning and the subscriber ends; the worker
  keeps the approximate view (routing decisions alone feed its table).

Why a quick subscriber can see nothing (measured on vLLM 0.32, CPU build, docs/operations.md):
- vLLM binds its PUB socket only for a wildcard endpoint (`tcp://*:PORT`, ipc, inproc) and CONNECTS to
  any other (`tcp://127.0.0.1:PORT`), expecting the subscriber to bind; two connecting sides never
  meet, and nothing says so. `kv_events.bind: true` makes the gateway the binding side.
- ZMQ's slow joiner: a SUB receives nothing published before its connection is made, and the
  publisher never waits, so a subscriber that connects as the request starts can miss its batch. The
  gateway subscribes when the backend joins the fleet, before any request, and replays when it can.
- A batch is only published when a whole KV block is cached: 128 tokens on vLLM's CPU build.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from duet.rpc import engine_pb2 as pb
from gateway.backends.backend_spec import KvEventsSpec
from gateway.backends.kv_events_decode import KvRehasher, UnknownEventFormat, decode_batch

log = logging.getLogger("duet.gateway.kv_events")

_KINDS = {"stored": pb.KvEvent.STORED, "evicted": pb.KvEvent.EVICTED, "cleared": pb.KvEvent.CLEARED}
_END = (-1).to_bytes(8, "big", signed=True)


def to_pb_batch(seq: int, payload: bytes, rehasher: KvRehasher) -> pb.KvEventBatch:
    """One engine batch as Duet's (UnknownEventFormat when it is not one)."""
    _, events = decode_batch(payload)
    out = pb.KvEventBatch(sequence=seq)
    for ev in events:
        applied = rehasher.apply(ev)
        if applied is not None:
            kind, hashes = applied
            out.events.append(pb.KvEvent(kind=_KINDS[kind], block_hashes=hashes))
    return out


def cleared(seq: int) -> pb.KvEventBatch:
    return pb.KvEventBatch(sequence=seq, events=[pb.KvEvent(kind=pb.KvEvent.CLEARED)])


class KvEventSubscriber:
    """`batches()` follows one publisher until cancelled (or until its format is unknown)."""

    def __init__(self, spec: KvEventsSpec, rehasher: KvRehasher, name: str, replay_timeout_s: float = 5.0) -> None:
        self.spec, self.rehasher, self.name = spec, rehasher, name
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self.expected: int | None = None  # the next sequence number wanted
        self.replayed = 0  # batches received through the replay socket (metrics, tests)

    async def batches(self) -> AsyncIterator[pb.KvEventBatch]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        if self.spec.bind:
            sub.bind(self.spec.endpoint)
        else:
            sub.connect(self.spec.endpoint)
        try:
            if self.spec.replay_endpoint:
                async for batch in self._replay(0):
                    yield batch
            while True:
                parts = await sub.recv_multipart()
                if len(parts) != 3 or len(parts[1]) != 8:
                    log.warning("KV events of %s: a message of %d parts is not (topic, seq, batch); "
                                "approximate cache view from now on", self.name, len(parts))
                    return
                seq = int.from_bytes(parts[1], "big")
                async for batch in self._one(seq, parts[2]):
                    yield batch
        except UnknownEventFormat as e:
            log.warning("KV events of %s are in an unknown format (%s); approximate cache view from now on",
                        self.name, e)
        finally:
            sub.close(linger=0)

    async def _one(self, seq: int, payload: bytes) -> AsyncIterator[pb.KvEventBatch]:
        if self.expected is not None and seq != self.expected:
            if seq == 0:  # the publisher started over: the engine's cache is empty
                self.rehasher.clear()
                yield cleared(seq)
            elif seq < self.expected:
                return  # already had it (through a replay)
            else:
                async for batch in self._gap(seq):
                    yield batch
        self.expected = seq + 1
        yield to_pb_batch(seq, payload, self.rehasher)

    async def _gap(self, seq: int) -> AsyncIterator[pb.KvEventBatch]:
        missing_from = self.expected
        log.warning("KV events of %s: batches %d..%d lost", self.name, missing_from, seq - 1)
        if self.spec.replay_endpoint:
            async for batch in self._replay(missing_from, until=seq):
                yield batch
        if self.expected != seq:  # not (fully) replayed: start the worker's table over
            self.rehasher.clear()
            yield cleared(seq)

    async def _replay(self, start: int, until: int | None = None) -> AsyncIterator[pb.KvEventBatch]:
        """Batches start.. (below `until`) from the replay socket; self.expected follows them."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                try:
                    parts = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
                except TimeoutError:
                    log.warning("KV events of %s: no replay answer in %.0f s", self.name, self.replay_timeout_s)
                    return
                if len(parts) != 4 or parts[2] == _END:
                    return
                seq = int.from_bytes(parts[2], "big")
                if until is not None and seq >= until:
                    continue
                if self.expected is not None and seq < self.expected:
                    continue
                if self.expected is not None and seq > self.expected:  # the buffer no longer holds them
                    self.rehasher.clear()
                    yield cleared(seq)
                self.replayed += 1
                self.expected = seq + 1
                yield to_pb_batch(seq, parts[3], self.rehasher)
        finally:
            sock.close(linger=0)
