"""External KV events -> Duet block hashes (gateway/backends/kv_events_decode.py, gateway/backends/kv_events_sub.py).

The fixture `data/vllm_0.32_kv_event_batch.hex` was encoded by vLLM 0.32's own classes
(`vllm.distributed.kv_events.KVEventBatch` through msgspec): one BlockStored of two 128-token blocks
salted "tenant-a", a BlockRemoved of the second block, an AllBlocksCleared."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from duet.hashing import block_hashes
from duet.rpc import engine_pb2 as pb
from gateway.backends.kv_events_decode import (
    CLEARED,
    REMOVED,
    STORED,
    KvRehasher,
    UnknownEventFormat,
    decode_batch,
)
from gateway.backends.kv_events_sub import to_pb_batch

REAL = bytes.fromhex((Path(__file__).parent / "data" / "vllm_0.32_kv_event_batch.hex").read_text())
MODEL = "smollm2-135m-instruct"
TOKENS = list(range(100, 356))


def test_real_vllm_batch_decodes():
    ts, events = decode_batch(REAL)
    assert ts == 1.5
    assert [e.kind for e in events] == [STORED, REMOVED, CLEARED]
    assert events[0].fields["block_size"] == 128 and events[0].fields["extra_keys"][0] == ["tenant-a"]


def test_real_batch_rehashes_into_the_gateways_own_hashes():
    """The gateway's hashes of the same prompt (16-token blocks, the tenant's salt) are what it stores."""
    rehasher = KvRehasher(MODEL, 16)
    batch = to_pb_batch(7, REAL, rehasher)
    assert batch.sequence == 7
    stored, evicted, cleared = batch.events
    expected = block_hashes(TOKENS, 16, MODEL, "tenant-a")
    assert stored.kind == pb.KvEvent.STORED and list(stored.block_hashes) == expected
    # removing vLLM's second block takes away the 8 Duet blocks inside it, by vLLM's id
    assert evicted.kind == pb.KvEvent.EVICTED and list(evicted.block_hashes) == expected[8:]
    assert cleared.kind == pb.KvEvent.CLEARED and len(rehasher) == 0


def _stored(hashes, parent, tokens, block_size, **extra) -> dict:
    return {"type": STORED, "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def _batch(*events) -> bytes:
    return msgpack.packb([0.0, list(events)])


def test_a_child_block_continues_its_parents_chain():
    rehasher = KvRehasher(MODEL, 16)
    first = to_pb_batch(0, _batch(_stored([11], None, TOKENS[:128], 128)), rehasher)
    second = to_pb_batch(1, _batch(_stored([12], 11, TOKENS[128:], 128)), rehasher)
    assert list(first.events[0].block_hashes) + list(second.events[0].block_hashes) == block_hashes(TOKENS, 16, MODEL)


def test_one_token_pages_add_up_to_gateway_blocks():
    """SGLang's radix cache stores one-token pages (tagged arrays): 16 of them make one Duet block."""
    rehasher = KvRehasher(MODEL, 16)
    events = [["BlockStored", [i + 1], i or None, [TOKENS[i]], 1, None] for i in range(40)]
    out = to_pb_batch(0, _batch(*events), rehasher)
    assert [h for e in out.events for h in e.block_hashes] == block_hashes(TOKENS[:40], 16, MODEL)


def test_blocks_whose_parent_came_before_the_subscription_are_skipped():
    rehasher = KvRehasher(MODEL, 16)
    out = to_pb_batch(0, _batch(_stored([12], 11, TOKENS[128:], 128)), rehasher)
    assert not out.events and rehasher.skipped_blocks == 1


def test_lora_blocks_and_other_groups_are_left_out():
    rehasher = KvRehasher(MODEL, 16)
    lora = _stored([1], None, TOKENS[:128], 128, lora_name="adapter", lora_id=3)
    group1 = _stored([2], None, TOKENS[:128], 128, group_idx=1)
    assert not to_pb_batch(0, _batch(lora, group1), rehasher).events


def test_removal_of_an_unknown_block_changes_nothing():
    rehasher = KvRehasher(MODEL, 16)
    assert not to_pb_batch(0, _batch({"type": REMOVED, "block_hashes": [b"x" * 32], "medium": "GPU"}), rehasher).events


@pytest.mark.parametrize("payload, says", [
    (b"\xc1not msgpack", "not msgpack"),
    (msgpack.packb({"hello": 1}), "a batch is"),
    (msgpack.packb([0.0, [{"type": "BlockMoved", "block_hashes": []}]]), "unknown event type"),
    (msgpack.packb([0.0, [{"type": STORED, "block_hashes": [1]}]]), "without token_ids"),
    (msgpack.packb([0.0, [42]]), "tagged map or array"),
])
def test_unknown_formats_are_refused_with_what_was_seen(payload, says):
    with pytest.raises(UnknownEventFormat, match=says):
        decode_batch(payload)
