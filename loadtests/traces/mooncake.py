"""Mooncake trace replay: records, and their prompts as deterministic token ids.

A Mooncake record (one JSON object a line) has `timestamp` (ms from the trace start),
`input_length`, `output_length` (tokens) and `hash_ids`: one id per 512-token block, chained
(two records share their first k ids exactly when their first k*512 tokens are equal). A gateway's
capture (gateway/control/capture.py) adds `session` (a hashed conversation key, "" for none), which the
reader keeps, and class, timing and engine fields, which it ignores.

`prompt_token_ids` turns the ids back into tokens: each id always becomes the same run of
512 token ids (drawn from a generator seeded by the id), and the last block is cut to fit
`input_length`. So two prompts share exactly their first k blocks of tokens when their
hash_ids share their first k ids - the trace's reuse structure, rebuilt for any tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from duet.contract import TRACE_BLOCK_TOKENS

MOONCAKE_BLOCK_TOKENS = TRACE_BLOCK_TOKENS


class TraceError(ValueError):
    """A trace file that cannot be replayed (names the file, line and problem)."""


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None  # the trace's own conversation id; "" = none; None = derive (session_key)


def json_lines(path: Path, what: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) for every non-blank line; a line that is not JSON is a TraceError
    saying the line was not `what`."""
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path}:{lineno}: not {what}: {e}") from None


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Read a Mooncake JSONL trace, in file order."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    what = "a Mooncake record (timestamp, input_length, output_length, hash_ids)"
    records = []
    for lineno, obj in json_lines(path, what):
        try:
            rec = TraceRecord(
                timestamp_ms=float(obj["timestamp"]),
                input_length=int(obj["input_length"]),
                output_length=int(obj["output_length"]),
                hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                # a gateway capture (gateway/control/capture.py) adds its hashed session key
                session=None if obj.get("session") is None else str(obj["session"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{path}:{lineno}: not {what}: {e}") from None
        if rec.input_length < 1 or not rec.hash_ids:
            raise TraceError(f"{path}:{lineno}: empty prompt")
        records.append(rec)
    if not records:
        raise TraceError(f"{path}: no records")
    return records


@lru_cache(maxsize=65_536)
def block_token_ids(hash_id: int, low: int, high: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[int, ...]:
    """The fixed run of `block_tokens` token ids in [low, high) that stands for `hash_id`."""
    if not 0 <= low < high:
        raise ValueError(f"token id range must satisfy 0 <= low < high, got [{low}, {high})")
    rng = np.random.Generator(np.random.PCG64([hash_id & 0xFFFFFFFFFFFFFFFF, low, high]))
    return tuple(int(t) for t in rng.integers(low, high, size=block_tokens))


def prompt_token_ids(
    rec: TraceRecord, vocab_size: int, low: int = 0, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[int]:
    """The record's prompt: its blocks' token runs, the last one cut to `input_length`.

    `low` lets the caller keep special tokens (often the first ids of a vocabulary) out."""
    out: list[int] = []
    for h in rec.hash_ids:
        out.extend(block_token_ids(h, low, vocab_size, block_tokens))
        if len(out) >= rec.input_length:
            break
    if len(out) < rec.input_length:
        raise TraceError(
            f"record has {len(rec.hash_ids)} blocks of {block_tokens} tokens, "
            f"too few for input_length {rec.input_length}"
        )
    return out[: rec.input_length]


def session_key(rec: TraceRecord) -> str | None:
    """A conversation id for a record. Mooncake has no session field; every record starts with
    the shared system-prompt block, so the second block is the first one that belongs to one
    conversation, and every later turn of it resends that block. None for a one-block prompt.
    A record that carries its own session (other trace formats: loadtests.traces.formats) keeps it."""
    if rec.session is not None:
        return rec.session or None
    return f"conv-{rec.hash_ids[1]}" if len(rec.hash_ids) > 1 else None


def turn_gaps_s(records: list[TraceRecord]) -> list[float]:
    """Seconds between consecutive requests of one conversation (`session_key`), in trace order: the
    think time of a user plus the answer's own time. On the shipped conversation trace: 4,658 gaps, median
    123 s, p90 480 s."""
    last: dict[str, float] = {}
    gaps = []
    for rec in records:
        key = session_key(rec)
        if key is None:
            continue
        if key in last:
            gaps.append((rec.timestamp_ms - last[key]) / 1000.0)
        last[key] = rec.timestamp_ms
    return gaps
