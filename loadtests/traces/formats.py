"""Request traces in the three formats `duet bench simulate-routing` and `duet bench advise` read,
as Mooncake-style records (loadtests.traces.mooncake.TraceRecord: arrival, lengths, chained block ids),
each format by its one reader:

- Mooncake JSONL (traces/mooncake.py): `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.
- Azure LLM inference CSV (traces/azure.py): `TIMESTAMP,ContextTokens,GeneratedTokens`, no reuse.
- OpenAI request log (traces/openai_log.py): one request body a line, prompt text cut into blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.traces.azure import load_azure
from loadtests.traces.mooncake import TraceError, TraceRecord, load_trace
from loadtests.traces.openai_log import load_openai_log

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
