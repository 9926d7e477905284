"""Request traces in the three formats `duet bench simulate-routing` and `duet bench advise` read,
as Mooncake-style records (loadtests.mooncake.TraceRecord: arrival, lengths, chained block ids).

- Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (as is).
- Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`. No prompt content, so no
  reuse information: every request gets fresh block ids (nothing is shared) and no session.
- OpenAI request log: one JSON object a line, the request body (`messages` or `prompt`,
  `max_tokens`/`max_completion_tokens`, optional `user`), optionally wrapped as
  `{"request": {...}, "response": {...}}` or `{"body": {...}}`, with `timestamp` (seconds, or an
  ISO 8601 string) and `usage.completion_tokens` when the response was logged. The prompt text is
  cut into blocks of 512 x 4 characters (about 512 tokens: no tokenizer is needed to see which
  prompts share a prefix) and each block's id is a hash chained over the blocks before it, so two
  prompts share their first k ids exactly when their first k blocks of text are equal.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from datetime import datetime
from pathlib import Path

from loadtests.mooncake import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRecord, json_lines, load_trace

CHARS_PER_TOKEN = 4  # the usual rule of thumb for English text and BPE vocabularies
FORMATS = ("mooncake", "azure", "openai")


def detect_format(path: str | Path) -> str:
    """`mooncake`, `azure` or `openai`, from the file's first non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    with path.open() as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:1: not JSON: {e}") from None
        return "mooncake" if "hash_ids" in obj else "openai"
    if "ContextTokens" in first and "GeneratedTokens" in first:
        return "azure"
    raise TraceError(f"{path}: not a Mooncake JSONL, Azure CSV or OpenAI request log (first line: {first[:80]!r})")


def load_any(path: str | Path, fmt: str | None = None) -> list[TraceRecord]:
    """The trace's records in arrival order, whatever its format (`fmt` None: detected)."""
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        return sorted(load_trace(path), key=lambda r: r.timestamp_ms)
    if fmt == "azure":
        return load_azure(path)
    if fmt == "openai":
        return load_openai_log(path)
    raise TraceError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _fresh_ids(start: int, tokens: int) -> tuple[int, ...]:
    return tuple(range(start, start + max(1, math.ceil(tokens / MOONCAKE_BLOCK_TOKENS))))


def _azure_time(text: str) -> float:
    """Seconds since the epoch of '2023-11-16 18:17:03.9799600' (7 fraction digits: more than
    datetime.fromisoformat takes everywhere)."""
    whole, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)


def load_azure(path: str | Path) -> list[TraceRecord]:
    path = Path(path)
    rows = []
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            try:
                rows.append((_azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{path}:{lineno}: not an Azure trace row (TIMESTAMP, ContextTokens, "
                                 f"GeneratedTokens): {e}") from None
    if not rows:
        raise TraceError(f"{path}: no records")
    rows.sort()
    t0 = rows[0][0]
    records, next_id = [], 1 << 40  # far from any Mooncake id
    for t, context, generated in rows:
        ids = _fresh_ids(next_id, max(1, context))
        next_id += len(ids)
        records.append(TraceRecord((t - t0) * 1000.0, max(1, context), max(1, generated), ids, session=""))
    return records


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        # role and content, in order: the rendered chat differs from this only by template tokens
        return "".join(f"<{m.get('role', '')}>{_content(m.get('content'))}" for m in body["messages"])
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = "".join(map(str, prompt))
    if not isinstance(prompt, str):
        raise TypeError("no 'messages' or 'prompt'")
    return prompt


def _content(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _timestamp(value) -> float:
    if isinstance(value, str):
        return datetime.fromisoformat(value).timestamp()  # Python 3.11 reads a trailing Z
    return float(value)


def text_block_ids(text: str, block_chars: int = MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN) -> tuple[int, ...]:
    """Chained ids of `text`'s blocks: id k hashes block k and id k-1."""
    ids, prev = [], b""
    for i in range(0, max(1, len(text)), block_chars):
        digest = hashlib.blake2b(prev + text[i:i + block_chars].encode(), digest_size=8).digest()
        ids.append(int.from_bytes(digest, "big") >> 1)  # below 2**63: JSON- and numpy-safe
        prev = digest
    return tuple(ids)


def load_openai_log(path: str | Path) -> list[TraceRecord]:
    path = Path(path)
    what = "an OpenAI request log line"
    records = []
    for lineno, obj in json_lines(path, what):
        try:
            body = obj.get("request") or obj.get("body") or obj
            text = _prompt_text(body)
            usage = (obj.get("response") or {}).get("usage") or obj.get("usage") or {}
            output = usage.get("completion_tokens") or body.get("max_completion_tokens") \
                or body.get("max_tokens") or 256
            ts = obj.get("timestamp", body.get("timestamp"))
            records.append(TraceRecord(
                timestamp_ms=1000.0 * (_timestamp(ts) if ts is not None else float(len(records))),
                input_length=max(1, math.ceil(len(text) / CHARS_PER_TOKEN)),
                output_length=max(1, int(output)),
                hash_ids=text_block_ids(text),
                session=body.get("user") or None,
            ))
        except (AttributeError, TypeError, ValueError) as e:
            raise TraceError(f"{path}:{lineno}: not {what}: {e}") from None
    if not records:
        raise TraceError(f"{path}: no records")
    records.sort(key=lambda r: r.timestamp_ms)
    t0 = records[0].timestamp_ms
    return [TraceRecord(r.timestamp_ms - t0, r.input_length, r.output_length, r.hash_ids, r.session)
            for r in records]
