"""The traffic capture: the shape of each request as a Mooncake trace record, and nothing of its content.

One JSON line per captured request, what loadtests/traces/mooncake.py reads (and so `duet bench advise` replays):

    {"timestamp": arrival, ms since the epoch, "input_length": prompt tokens, "output_length": generated tokens,
     "hash_ids": [one id per TRACE_BLOCK_TOKENS-token block, chained], "session": "s-<hash>" or "",
     "class": traffic class, "engine": engine kind, "model": model id, "ttft_ms": ..., "tpot_ms": ...}

Privacy: `hash_ids` are duet/hashing.py's chained block hashes (the gateway's one block hashing) of the prompt at
the trace's block size, with the deployment's salt in the chain's root: two prompts of one deployment share their
first k ids exactly when they share their first k blocks, but without the salt no id can be matched to a text
(no dictionary attack on a common system prompt) nor to another deployment's capture. The last, partial block's
id chains its tail in too. The session key is hashed with the same salt. The salt is random, made once per
deployment by the state store (Redis: shared by every replica; in memory: per gateway process) and never
served: the admin API exports records only. No token id or text is ever stored.

Bounds (`CaptureConfig`, the gateway config's `capture:` section): a sampling rate (per session, so a sampled
conversation keeps all its turns; per request without one), the models captured, `max_records` (the oldest go
first) and `max_age_s` (older records are rotated out at export). Records are buffered in the gateway and
flushed to the state store once a second (`run`), so the request path never waits on Redis; when the store is
down a flush's records are dropped and counted (`dropped`).

A record's line is written by hand rather than by `json.dumps` of a dict (`_line`, the same bytes): on the gateway's
burst (loadtests/experiments/profile_cost.py under py-spy) the capture was ~0.9% of the gateway's CPU, mostly the
prompt's hashing and that `json.dumps` (4.0 us against 1.5 us written by hand, in process).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b

from duet.contract import TRACE_BLOCK_TOKENS
from duet.hashing import block_hashes, chain_hash, root_hash
from gateway.control.state import StateUnavailable
from gateway.ticks import sleep_to_tick

log = logging.getLogger("duet.gateway.capture")
FLUSH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class CaptureConfig:
    enabled: bool = False
    sample_rate: float = 1.0  # share of sessions (session-less: requests) captured
    max_records: int = 100_000  # kept in the state store, newest; about 200 bytes each (20 more per 512 prompt tokens)
    max_age_s: float | None = None  # rotation: older records are dropped at export; None: kept until pushed out
    models: tuple[str, ...] = ()  # the models captured; empty: every model

    def validate(self) -> CaptureConfig:
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"capture.sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.max_records < 1:
            raise ValueError(f"capture.max_records must be >= 1, got {self.max_records}")
        if self.max_age_s is not None and not self.max_age_s > 0:
            raise ValueError(f"capture.max_age_s must be > 0 (or null), got {self.max_age_s}")
        return self


def salted_ids(prompt_ids: Sequence[int], model_id: str, salt: str, tenant_salt: str = "") -> list[int]:
    """The record's `hash_ids`: chained hashes of the prompt's trace blocks, the last partial one included,
    rooted in the deployment's salt (and the tenant's cache salt, so tenants never share ids)."""
    root_salt = f"{salt}\x00{tenant_salt}"
    ids = block_hashes(prompt_ids, TRACE_BLOCK_TOKENS, model_id, root_salt)
    tail = prompt_ids[len(ids) * TRACE_BLOCK_TOKENS:]
    if tail or not ids:
        ids.append(chain_hash(ids[-1] if ids else root_hash(model_id, root_salt), tail))
    return ids


def salted_key(key: str, salt: str) -> int:
    """A 64-bit hash of `key` under the deployment's salt."""
    return int.from_bytes(blake2b(key.encode(), digest_size=8, key=salt.encode()[:64]).digest(), "little")


@lru_cache(maxsize=1024)
def _quoted(text: str) -> str:
    """A JSON string (a model id, a class, an engine kind: few distinct ones, so each is quoted once)."""
    return json.dumps(text)


def _ms(seconds: float | None) -> str:
    return "null" if seconds is None else repr(round(seconds * 1000, 3))  # json.dumps writes a float's repr


def _line(timestamp_ms: int, input_length: int, output_length: int, hash_ids: list[int], session: str,
          traffic_class: str, engine: str, model: str, ttft_s: float | None, tpot_s: float | None) -> str:
    """One record, byte for byte what `json.dumps(record, separators=(",", ":"))` writes for it (the module
    docstring's field order); `session` is "" or "s-" and hex digits, written unquoted-safe."""
    return (f'{{"timestamp":{timestamp_ms},"input_length":{input_length},"output_length":{output_length},'
            f'"hash_ids":[{",".join(map(str, hash_ids))}],"session":"{session}","class":{_quoted(traffic_class)},'
            f'"engine":{_quoted(engine)},"model":{_quoted(model)},"ttft_ms":{_ms(ttft_s)},"tpot_ms":{_ms(tpot_s)}}}')


class TraceCapture:
    def __init__(self, config: CaptureConfig, state) -> None:
        self.config = config.validate()
        self.state = state  # gateway.control.state.StateStore: the salt and the shared records
        self.salt: str | None = None  # loaded by `run` from the state store; nothing is captured before
        self._buffer: list[str] = []
        self.captured = 0
        self.dropped = 0
        self._models = frozenset(config.models)
        self._threshold = int(config.sample_rate * (1 << 64))

    def wants(self, model: str, session: str | None) -> bool:
        if not self.config.enabled or self.salt is None or (self._models and model not in self._models):
            return False
        if self._threshold >= 1 << 64:
            return True
        # per session: every replica (same salt) takes the same sessions, and a conversation is whole
        draw = salted_key(session, self.salt) if session else random.getrandbits(64)
        return draw < self._threshold

    def record(self, *, model: str, prompt_ids: Sequence[int], tenant_salt: str, session: str | None,
               output_tokens: int, traffic_class: str, engine: str, duration_s: float, ttft_s: float | None,
               tpot_s: float | None) -> None:
        """Capture one request that ended `duration_s` seconds after it arrived (when the config wants it)."""
        if not self.wants(model, session):
            return
        salt = self.salt
        self._buffer.append(_line(int((time.time() - duration_s) * 1000), len(prompt_ids), output_tokens,  # arrival
                                  salted_ids(prompt_ids, model, salt, tenant_salt),
                                  f"s-{salted_key(session, salt):016x}" if session else "", traffic_class, engine,
                                  model, ttft_s, tpot_s))
        self.captured += 1

    async def flush(self) -> None:
        """Load the salt when not yet loaded, then push the buffered records to the state store."""
        if not self.config.enabled:
            return
        lines: list[str] = []
        try:
            if self.salt is None:
                self.salt = await self.state.capture_salt()
            lines, self._buffer = self._buffer, []
            if lines:
                await self.state.append_capture(lines, self.config.max_records)
        except StateUnavailable as e:  # the salt unknown: nothing was captured; else these lines are lost
            if self.salt is not None:
                self.dropped += len(lines)
            log.debug("capture flush failed: %s", e)

    async def run(self) -> None:
        while True:
            try:
                await self.flush()
            except Exception:  # a bad flush must not stop the next ones (or the gateway)
                log.exception("capture flush failed")
            await sleep_to_tick(FLUSH_INTERVAL_S)

    async def export(self) -> list[str]:
        """Every kept record (JSON lines, oldest first), after the buffer is flushed; records older than
        `max_age_s` are left out."""
        await self.flush()
        lines = await self.state.capture_lines()
        if self.config.max_age_s is None:
            return lines
        horizon = (time.time() - self.config.max_age_s) * 1000
        return [line for line in lines if json.loads(line)["timestamp"] >= horizon]
