"""The Azure LLM inference trace (CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`), as Mooncake-style records.

The one reader of the format, for the simulator and advise (`traces.formats.load_any`) and for the
benchmark workloads `azure-conv` / `azure-code` (`load.trace_workloads.azure`). No prompt content, so no
reuse information: every request gets fresh block ids (nothing is shared) and no session.

Semantics kept from the two readers this one replaces:
- Timestamps are local wall-clock times with 7 fraction digits ('2023-11-16 18:17:03.9799600'); the
  whole seconds go through `datetime.fromisoformat` (which reads the trace's 'YYYY-MM-DD HH:MM:SS' as
  `strptime` did, and ISO 8601 forms besides) and the fraction is added as a float, since
  `fromisoformat` does not take seven digits on every Python.
- Records come in arrival order (a stable sort on the timestamp, so rows with the same timestamp keep
  their file order). A replay needs arrival order, and arrival offsets are taken from the earliest
  record; on the traces we ship (loadtests/traces/data) file order already is arrival order, with no ties, so
  both old readers gave these same records there.
"""

from __future__ import annotations

import csv
import math
from datetime import datetime
from pathlib import Path

from loadtests.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRecord

FIRST_FRESH_ID = 1 << 40  # far from any Mooncake id


def _seconds(text: str) -> float:
    """Seconds since the epoch of '2023-11-16 18:17:03.9799600'."""
    whole, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)


def _fresh_ids(start: int, tokens: int) -> tuple[int, ...]:
    return tuple(range(start, start + max(1, math.ceil(tokens / MOONCAKE_BLOCK_TOKENS))))


def load_azure(path: str | Path) -> list[TraceRecord]:
    """The trace's records in arrival order, times in ms from the first; lengths at least 1."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    rows = []
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            try:
                rows.append((_seconds(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise TraceError(f"{path}:{lineno}: not an Azure trace row (TIMESTAMP, ContextTokens, "
                                 f"GeneratedTokens): {e}") from None
    if not rows:
        raise TraceError(f"{path}: no records")
    rows.sort(key=lambda row: row[0])
    t0 = rows[0][0]
    records, next_id = [], FIRST_FRESH_ID
    for t, context, generated in rows:
        ids = _fresh_ids(next_id, max(1, context))
        next_id += len(ids)
        records.append(TraceRecord((t - t0) * 1000.0, max(1, context), max(1, generated), ids, session=""))
    return records
