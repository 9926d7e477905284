"""A request inside the paged engine (`SequenceGroup`) and its sequences (`Sequence`: one output
index, or one beam). A group starts with one sequence holding the prompt; when the prompt's
prefill completes, n > 1 and beam search fork it (the block manager shares the pages).
`ScheduledSeq` is one sequence's share of a step: the entries of the engine_core `SchedulerOutput` the
scheduler makes and the output processor consumes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from enum import Enum

import torch

from duet.contract import FinishReason
from engine_core.request import Request, TokenLogprob

_seq_ids = itertools.count()


class TokenTail(SequenceABC):
    """`ids[start:]` read in place: the sampler and the stopping rule look at a sequence's output every
    step, and a copy would make each step O(prompt + output) instead of O(new tokens)."""

    __slots__ = ("_ids", "_start")

    def __init__(self, ids: list[int], start: int) -> None:
        self._ids, self._start = ids, start

    def __len__(self) -> int:
        return len(self._ids) - self._start

    def __getitem__(self, i):
        positions = range(self._start, len(self._ids))[i]  # bounds and negative indices as a list's tail has them
        return [self._ids[j] for j in positions] if isinstance(i, slice) else self._ids[positions]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._start, None)


class GroupStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    index: int  # output index (beam search: assigned at the end, by rank)
    token_ids: list[int]  # prompt + output
    num_prompt: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0  # tokens whose KV is in the pages
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_sent: int = 0  # output tokens already streamed
    finish_reason: FinishReason | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """A copy; per-step code reads `outputs` (no copy) or `num_output`."""
        return self.token_ids[self.num_prompt:]

    @property
    def outputs(self) -> TokenTail:
        return TokenTail(self.token_ids, self.num_prompt)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy_as(self, index: int, generator: torch.Generator | None) -> Sequence:
        """A fork: same tokens and progress, a new id (the caller forks the block table)."""
        return Sequence(index, list(self.token_ids), self.num_prompt, generator, num_computed=self.num_computed,
                        logprobs=list(self.logprobs), cumulative_logprob=self.cumulative_logprob,
                        num_sent=self.num_sent)


@dataclass
class SequenceGroup:
    request: Request
    seqs: list[Sequence]  # live and finished outputs (beam search: live beams only)
    order: tuple  # waiting-queue key: (priority, arrival, admission counter)
    status: GroupStatus = GroupStatus.WAITING
    forked: bool = False  # n > 1 / beams already made from the prompt sequence
    prompt_sent: bool = False
    cached_tokens: int | None = None  # prompt tokens the prefix cache held at first admission
    beams_done: list[Sequence] = field(default_factory=list)  # beam search: finished hypotheses
    beam_logits: dict = field(default_factory=dict)  # beam search: seq_id -> this step's logits row
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # gathered while the prompt prefills

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own logprobs are asked for and not sent yet: its prefill needs every position's
        logits, so it cannot start from the prefix cache (a cached prefix's logits were never kept)."""
        return self.request.params.prompt_logprobs is not None and not self.prompt_sent

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_beam(self) -> bool:
        return self.request.params.beam_width > 1

    @property
    def width(self) -> int:
        """Sequences this group runs once forked (counts against --max-num-seqs)."""
        p = self.request.params
        return p.beam_width if self.is_beam else p.n

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]


@dataclass
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_tokens: int
    wants_logits: bool
    prompt_rows: int = 0  # leading logits rows that score prompt tokens (before the sampling row, if any)
