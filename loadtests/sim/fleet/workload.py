"""The fleet simulator's requests, from the shipped traces (loadtests/traces/shipped.py; read by loadtests/traces/).

Two traffic classes:
- `chat`: turns of the Mooncake conversation trace (Kimi chat; every prompt starts with one shared system
  prompt block, later turns resend the conversation: 37% of its tokens repeat an earlier prefix). A turn's
  session is `loadtests.traces.mooncake.session_key` (the conversation's first own block), so routing gets
  the session header a chat client sends. Think times are the trace's: a turn arrives at its own (scaled)
  timestamp, but never before the previous turn of its session has been answered (a user reads the answer
  before writing the next turn), so an overloaded stack also sees its conversations slow down.
- `document`: one-shot prompts of the Azure code trace (lengths and arrivals only; no content, so nothing
  is shared: unrelated documents), no session.

`build(sources, window_s, rate)` takes each source's records whose timestamp falls in the first `window_s`
seconds of that trace, scales each source's arrival rate by `rate` x its own multiplier (timestamps divided),
and merges them. The standard mixes (`MIXES`): `mixed` = Mooncake x1 + Azure code x1 (over a trace window,
about 3.4 chat turns/s of 12k tokens mean and 2.6 documents/s of 2k tokens), `chat` = Mooncake alone,
`documents` = Azure code alone. Prompts are rebuilt as token ids (`prompt_token_ids`: each trace block id is a
fixed run of 512 ids, so shared prefixes stay shared) when the request is sent, not held in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from duet.traffic_classes import FLEET_CLASSES
from loadtests.load.workloads import WorkloadError, parse_shares
from loadtests.sim.fleet.engine import VOCAB
from loadtests.traces import shipped
from loadtests.traces.mooncake import TraceRecord, prompt_token_ids, session_key

SOURCES = {"mooncake": "chat", "azure_code": "document", "azure_conv": "document"}  # shipped name -> class
MIXES = {"mixed": {"mooncake": 1.0, "azure_code": 1.0}, "chat": {"mooncake": 1.0}, "documents": {"azure_code": 1.0}}
CLASSES = tuple(FLEET_CLASSES)  # chat, document: duet/traffic_classes.py says which table class each is


@dataclass(frozen=True)
class FleetRequest:
    request_id: str
    arrival_s: float  # scaled trace time; a later chat turn also waits for the previous one (module doc)
    record: TraceRecord
    traffic_class: str
    session: str | None
    turn: int  # 1 for the first turn of a session (and every document)
    max_tokens: int
    max_prompt_tokens: int | None = None  # cut the prompt's tail (its shared head stays shared)

    def prompt(self, max_model_len: int) -> list[int]:
        ids = prompt_token_ids(self.record, VOCAB, low=1)
        return ids[: min(self.max_prompt_tokens or max_model_len, max_model_len - self.max_tokens)]


def parse_mix(text: str) -> dict[str, float]:
    """`mixed`, `chat`, `documents`, `source=multiplier,...` (sources: mooncake, azure_code, azure_conv; a source
    at 0 is left out), or the path of a trace file (any format loadtests/traces/formats.py reads)."""
    if text in MIXES:
        return dict(MIXES[text])
    if Path(text).is_file():
        return {text: 1.0}
    try:
        shares = parse_shares(text, tuple(SOURCES), "--trace", "source")
    except WorkloadError as e:
        raise WorkloadError(f"{e}; or a mix: {', '.join(MIXES)}; or a trace file") from None
    return {name: share for name, share in shares.items() if share > 0}


@lru_cache(maxsize=8)
def _records(name: str, data_dir: str) -> tuple[TraceRecord, ...]:
    from loadtests.traces.formats import load_any

    path = shipped.path_of(name, Path(data_dir)) if name in SOURCES else Path(name)
    if not path.is_file():
        raise WorkloadError(f"trace {path} not found (the shipped traces are in {shipped.SHIPPED_DIR}; "
                            f"{shipped.ENV} or --trace-dir points elsewhere)")
    return tuple(load_any(path))


def _class_of(name: str, rec: TraceRecord) -> str:
    """A named source's class; in a team's own trace file, a record with a session is a chat turn."""
    return SOURCES[name] if name in SOURCES else ("chat" if session_key(rec) is not None else "document")


def build(mix: dict[str, float], window_s: float, rate: float, max_model_len: int, data_dir: Path | None = None,
          max_output_tokens: int | None = None, max_prompt_tokens: int | None = None,
          start_s: float = 0.0) -> list[FleetRequest]:
    """The requests of `mix` over `window_s` trace seconds from `start_s` (default: the traces' start) at `rate` x,
    in arrival order, timed from the window's start."""
    if window_s <= 0 or rate <= 0 or start_s < 0:
        raise WorkloadError(f"--window-s and --rate must be > 0 and the start >= 0, got {window_s}, {rate} and {start_s}")
    out = []
    for name, multiplier in mix.items():
        records = _records(name, str(data_dir or shipped.trace_dir()))
        t0 = records[0].timestamp_ms
        turns: dict[str, int] = {}
        for i, rec in enumerate(records):
            t = (rec.timestamp_ms - t0) / 1000.0 - start_s
            if t < 0:
                continue
            if t >= window_s:
                break
            cls = _class_of(name, rec)
            session = session_key(rec) if cls == "chat" else None
            if session is not None:
                turns[session] = turns.get(session, 0) + 1
            out_tokens = max(1, rec.output_length if max_output_tokens is None else min(rec.output_length,
                                                                                      max_output_tokens))
            out_tokens = min(out_tokens, max_model_len // 2)
            out.append(FleetRequest(f"{Path(name).name}-{i}", t / (rate * multiplier), rec, cls, session,
                                    turns.get(session, 1) if session else 1, out_tokens, max_prompt_tokens))
    if not out:
        raise WorkloadError("the workload is empty: widen --window-s")
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out
