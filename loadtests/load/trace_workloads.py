"""Real traces as benchmark workloads (the shipped ones: loadtests/traces/data/README.md).

    mooncake(path, src, num_requests, max_prompt_tokens, max_tokens, time_scale) -> list[BenchRequest]
    azure(path, traffic_class, src, num_requests, max_prompt_tokens, max_tokens, time_scale) -> list[BenchRequest]

Arrival times are the trace's (seconds from its first record) times `time_scale` (0.5 = twice as
fast). Prompt lengths are cut to `max_prompt_tokens` and output lengths to `max_tokens` so a trace
recorded on a large model fits a small one; Mooncake prompts keep their shared-prefix structure
when cut (a cut prompt is a prefix of the full one).
"""

from __future__ import annotations

from pathlib import Path

from loadtests.load.workloads import BenchRequest, TokenSource, WorkloadError
from loadtests.traces.azure import load_azure
from loadtests.traces.mooncake import TraceError, load_trace, session_key


def mooncake(path: str | Path, src: TokenSource, num_requests: int | None, max_prompt_tokens: int,
             max_tokens: int, time_scale: float = 1.0) -> list[BenchRequest]:
    """Each record's hash ids become fixed token blocks (`TokenSource.block`); the session header is the
    conversation the trace implies (`mooncake.session_key`)."""
    _check_scale(time_scale)
    records = load_trace(path)[:num_requests]
    t0 = records[0].timestamp_ms
    out = []
    for i, rec in enumerate(records):
        n = min(rec.input_length, max_prompt_tokens)
        ids: list[int] = []
        for h in rec.hash_ids:
            if len(ids) >= n:
                break
            ids += src.block(h)
        if len(ids) < n:
            raise TraceError(f"{path}: record {i} has too few hash_ids for input_length {rec.input_length}")
        sid = session_key(rec)
        out.append(BenchRequest(f"mooncake-{i}", "mooncake", tuple(ids[:n]), max(1, min(rec.output_length, max_tokens)),
                                arrival_s=(rec.timestamp_ms - t0) / 1000.0 * time_scale, session_id=sid))
    return out


def azure(path: str | Path, traffic_class: str, src: TokenSource, num_requests: int | None,
          max_prompt_tokens: int, max_tokens: int, time_scale: float = 1.0) -> list[BenchRequest]:
    """Azure traces carry no prompt content: each request is an unrelated run of its context length
    (records from traces.azure, the one reader of the format, in arrival order)."""
    _check_scale(time_scale)
    out = []
    for i, rec in enumerate(load_azure(path)[:num_requests]):
        rid = f"{traffic_class}-{i}"
        n = min(rec.input_length, max_prompt_tokens)
        out.append(BenchRequest(rid, traffic_class, tuple(src.draw(rid, n)), min(rec.output_length, max_tokens),
                                arrival_s=rec.timestamp_ms / 1000.0 * time_scale))
    return out


def _check_scale(time_scale: float) -> None:
    if not time_scale > 0:
        raise WorkloadError(f"--time-scale must be positive, got {time_scale}")
