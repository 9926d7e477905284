"""The five traffic classes of `duet bench classes`, built from the synthetic generators of workloads.py.

    CLASSES                                     long_doc, multi_turn, agent, structured, copy_edit
    Sizes                                       prompt and output lengths of each class (frozen)
    class_workload(name, src, n, seed, sizes, think_gaps_s, think_scale) -> list[BenchRequest]
    class_mix(src, n, seed, sizes, think_gaps_s, think_scale)           all five, equal shares, interleaved
    mooncake_think_gaps(path) -> list[float]    the conversation trace's gaps between turns (seconds)

- long_doc: unrelated one-shot documents of `doc_tokens` (1-4k by default): nothing to reuse, the
  paged design's traffic in the seed.
- multi_turn: chat sessions (workloads.multi_turn) whose later turns wait a think time drawn, seeded,
  from the Mooncake conversation trace's gaps between a conversation's requests, times `think_scale`
  (the trace's median gap is 123 s; a two-minute run needs them shorter: 0.05 makes it about 6 s).
- agent: agent loops over one long shared tool head (workloads.agent), no think time (tools are fast).
- structured: one shared instruction head plus a question, answered under a JSON schema
  (response_format json_schema): engine_prefix only (the paged engine has no grammar; the gateway refuses).
- copy_edit: a shared edit instruction plus an own passage, with a long answer: the case where n-gram
  speculation can pay (an answer that repeats its prompt).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests.load.workloads import (
    BenchRequest,
    TokenSource,
    WorkloadError,
    agent,
    long_doc,
    mix,
    multi_turn,
)
from loadtests.traces import shipped
from loadtests.traces.mooncake import load_trace, turn_gaps_s

CLASSES = ("long_doc", "multi_turn", "agent", "structured", "copy_edit")
PREFIX_ONLY = ("structured",)  # classes the paged engine cannot serve
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}, "score": {"type": "integer"}},
    "required": ["answer", "score"], "additionalProperties": False}}}


@dataclass(frozen=True)
class Sizes:
    doc_tokens: tuple[int, int] = (1024, 4000)  # a document's prompt, min and max
    chat_tokens: int = 1024  # a session's budget: its last turn's prompt
    agent_tokens: int = 1536  # an agent loop's budget (half of it the shared tool head)
    structured_tokens: int = 320  # shared instruction (4/5) + own question
    copy_tokens: int = 448  # shared instruction (1/7) + own passage
    max_tokens: int = 32  # output of documents, chat turns and agent steps
    structured_max_tokens: int = 64
    copy_max_tokens: int = 128


DEFAULT_SIZES = Sizes()
QUICK_SIZES = Sizes(doc_tokens=(256, 512), chat_tokens=384, agent_tokens=384, structured_tokens=128,
                    copy_tokens=160, max_tokens=8, structured_max_tokens=24, copy_max_tokens=24)


def mooncake_think_gaps(path: str | Path | None = None) -> list[float]:
    return turn_gaps_s(load_trace(path or shipped.path_of("mooncake")))


def _with_think(requests: list[BenchRequest], gaps: list[float], scale: float, seed: int) -> list[BenchRequest]:
    if not gaps:
        return requests
    rng = np.random.Generator(np.random.PCG64(seed + 11))
    return [dataclasses.replace(r, think_s=float(rng.choice(gaps)) * scale) if r.depends_on else r for r in requests]


def _headed(src: TokenSource, n: int, traffic_class: str, head: list[int], own: int, max_tokens: int,
            seed: int, **extra) -> list[BenchRequest]:
    """One-shot requests: the shared `head`, then `own` tokens of each request's own."""
    return [BenchRequest(f"{traffic_class}-{i}", traffic_class, tuple(head + src.draw(f"{traffic_class}-{i}-{seed}", own)),
                         max_tokens, **extra) for i in range(n)]


def class_workload(name: str, src: TokenSource, n: int, seed: int = 0, sizes: Sizes = DEFAULT_SIZES,
                   think_gaps_s: tuple[float, ...] | list[float] = (), think_scale: float = 0.05) -> list[BenchRequest]:
    z = sizes
    if name == "long_doc":
        lo, hi = z.doc_tokens
        return long_doc(src, n, hi, z.max_tokens, seed, min_fraction=lo / hi)
    if name == "multi_turn":
        return _with_think(multi_turn(src, n, z.chat_tokens, z.max_tokens, seed), list(think_gaps_s), think_scale, seed)
    if name == "agent":
        return agent(src, n, z.agent_tokens, z.max_tokens, seed)
    if name == "structured":
        head = src.draw(f"structured-head-{seed}", z.structured_tokens * 4 // 5)
        return _headed(src, n, "structured", head, z.structured_tokens // 5, z.structured_max_tokens, seed,
                       response_format=ANSWER_SCHEMA)
    if name == "copy_edit":
        head = src.draw(f"copy-head-{seed}", z.copy_tokens // 7)
        return _headed(src, n, "copy_edit", head, z.copy_tokens - len(head), z.copy_max_tokens, seed)
    raise WorkloadError(f"unknown class {name!r} (one of {', '.join(CLASSES)})")


def class_mix(src: TokenSource, n: int, seed: int = 0, sizes: Sizes = DEFAULT_SIZES, think_gaps_s: tuple[float, ...] | list[float] = (),
              think_scale: float = 0.05, classes: tuple[str, ...] = CLASSES) -> list[BenchRequest]:
    """`classes` in equal shares of `n` requests, in a seeded random order (workloads.mix)."""
    def maker(name):
        return lambda src_, k, _p, _o, seed_: class_workload(name, src_, k, seed_, sizes, think_gaps_s, think_scale)

    return mix(src, n, 64, 1, seed, {c: 1.0 for c in classes}, makers={c: maker(c) for c in classes})
