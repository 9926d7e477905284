"""External engines' KV-cache events, decoded and rehashed into Duet's chained block hashes.

vLLM (and SGLang, whose publisher is a port of vLLM's) publishes msgpack `KVEventBatch`es: an array
`[ts, events, data_parallel_rank]`. Each event is either a map with a `type` tag (vLLM 0.32:
`{"type": "BlockStored", "block_hashes": [...], ...}`) or a tagged array with the fields in order
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`,
older vLLM and SGLang). Kinds: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.

The engine's own block hashes (vLLM: 32 bytes of SHA-256 by default, or ints) are opaque here: Duet
does not reproduce them. `KvRehasher` hashes the `token_ids` a BlockStored carries with
duet/hashing.py in the gateway's block size B, continuing the chain of the parent block, and keeps the
engine's ids only to find what a BlockRemoved takes away. An engine block need not be a multiple of B
(SGLang's radix cache stores pages of one token): the tokens past the last full B-block ride along in
the block's state and complete a Duet block in a child. A root block's salt is the `cache_salt` in its
`extra_keys` (vLLM puts it in the first block's keys, after the LoRA name when there is one).

What cannot be placed is skipped, never guessed: a block whose parent was stored before the gateway
subscribed, LoRA blocks (the gateway's hashes have no adapter), and groups other than the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from duet.hashing import chain_hash, root_hash

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
_FIELDS = {  # positional order of the tagged-array form
    STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
             "extra_keys", "group_idx"),
    REMOVED: ("block_hashes", "medium", "group_idx"),
    CLEARED: (),
}


class UnknownEventFormat(ValueError):
    """A payload that is not a KV event batch this decoder knows (the message says what it saw)."""


@dataclass(frozen=True)
class EngineEvent:
    kind: str  # STORED / REMOVED / CLEARED
    fields: dict


def _hashable(h):
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h


def _event(raw) -> EngineEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        raise UnknownEventFormat(f"an event must be a tagged map or array, got {raw!r:.120}")
    if kind not in _FIELDS:
        raise UnknownEventFormat(f"unknown event type {kind!r}")
    if kind != CLEARED and not isinstance(fields.get("block_hashes"), (list, tuple)):
        raise UnknownEventFormat(f"{kind} without block_hashes: {raw!r:.120}")
    if kind == STORED and not isinstance(fields.get("token_ids"), (list, tuple)):
        raise UnknownEventFormat(f"BlockStored without token_ids: {raw!r:.120}")
    return EngineEvent(kind, fields)


def decode_batch(payload: bytes) -> tuple[float, list[EngineEvent]]:
    """(ts, events) of one msgpack KVEventBatch; UnknownEventFormat for anything else."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise UnknownEventFormat(f"not msgpack: {e}") from None
    if isinstance(raw, dict):  # a map-encoded batch
        raw = [raw.get("ts"), raw.get("events")]
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise UnknownEventFormat(f"a batch is [ts, events, ...], got {raw!r:.120}")
    return float(raw[0] or 0.0), [_event(e) for e in raw[1]]


@dataclass(frozen=True)
class _BlockState:
    tail: int  # Duet hash of the last full Duet block up to the end of this engine block
    rest: tuple[int, ...]  # tokens after it (fewer than B)
    ours: tuple[int, ...]  # Duet hashes completed inside this engine block (removed with it)


class KvRehasher:
    """Engine events of one backend -> (kind, Duet block hashes) for gateway/routing/prefix_index.py."""

    def __init__(self, model_id: str, block_size: int) -> None:
        self.model_id, self.block_size = model_id, block_size
        self._blocks: dict[object, _BlockState] = {}
        self.skipped_blocks = 0  # engine blocks that could not be placed (module doc)

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()

    def apply(self, ev: EngineEvent) -> tuple[str, list[int]] | None:
        """("stored" | "evicted" | "cleared", hashes), or None when the event changes nothing Duet knows."""
        if ev.kind == CLEARED:
            self.clear()
            return "cleared", []
        if ev.fields.get("group_idx") not in (None, 0):
            return None
        if ev.kind == REMOVED:
            gone = [h for eh in ev.fields["block_hashes"] if (s := self._blocks.pop(_hashable(eh), None))
                    for h in s.ours]
            return ("evicted", gone) if gone else None
        stored = self._stored(ev.fields)
        return ("stored", stored) if stored else None

    def _stored(self, f: dict) -> list[int]:
        engine_hashes = [_hashable(h) for h in f["block_hashes"]]
        tokens = list(f["token_ids"])
        if f.get("lora_name") or f.get("lora_id") or not engine_hashes:
            self.skipped_blocks += len(engine_hashes)
            return []
        parent = f.get("parent_block_hash")
        if parent is None:
            state = _BlockState(root_hash(self.model_id, self._salt(f)), (), ())
        else:
            state = self._blocks.get(_hashable(parent))
            if state is None:  # stored before we subscribed: its chain cannot be continued
                self.skipped_blocks += len(engine_hashes)
                return []
        per_block = int(f.get("block_size") or 0) or len(tokens) // len(engine_hashes)
        out: list[int] = []
        for i, eh in enumerate(engine_hashes):
            state = self._extend(state, tokens[i * per_block:(i + 1) * per_block])
            self._blocks[eh] = state
            out.extend(state.ours)
        return out

    def _extend(self, parent: _BlockState, tokens: list[int]) -> _BlockState:
        B, tail = self.block_size, parent.tail
        pending = list(parent.rest) + tokens
        ours = []
        full = len(pending) // B * B
        for start in range(0, full, B):
            tail = chain_hash(tail, pending[start:start + B])
            ours.append(tail)
        return _BlockState(tail, tuple(pending[full:]), tuple(ours))

    @staticmethod
    def _salt(f: dict) -> str:
        keys = f.get("extra_keys") or ()
        first = list(keys[0] or ()) if keys else []
        if f.get("lora_name") and first:
            first = first[1:]
        return next((k for k in first if isinstance(k, str)), "")
