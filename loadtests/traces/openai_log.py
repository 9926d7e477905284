"""OpenAI request logs as Mooncake-style records: one JSON object a line, the request body (`messages` or
`prompt`, `max_tokens`/`max_completion_tokens`, optional `user`), optionally wrapped as
`{"request": {...}, "response": {...}}` or `{"body": {...}}`, with `timestamp` (seconds, or an ISO 8601
string) and `usage.completion_tokens` when the response was logged. The prompt text is cut into blocks
of 512 x 4 characters (about 512 tokens: no tokenizer is needed to see which prompts share a prefix) and
each block's id is a hash chained over the blocks before it, so two prompts share their first k ids
exactly when their first k blocks of text are equal.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime
from pathlib import Path

from loadtests.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRecord, json_lines

CHARS_PER_TOKEN = 4  # the usual rule of thumb for English text and BPE vocabularies


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
