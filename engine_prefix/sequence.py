"""A request inside engine_prefix (`Seq`, n=1) and its share of a step (`ScheduledSeq`: the entries of the
engine_core `SchedulerOutput` the scheduler makes and the output processor consumes).

Page ownership (the contract engine_prefix.block_manager keeps): ``pages`` is the request's page table;
``pages[:num_tree_pages]`` belong to the radix tree and are held by a lock on ``node``; the rest are private
to the request and freed (or inserted into the tree) when it finishes, is preempted or aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duet.contract import FinishReason
from engine_core.request import Request, TokenLogprob
from engine_prefix.radix_cache import Node
from engine_prefix.structured import Constraint


@dataclass
class Seq:
    """One request inside engine_prefix (n=1)."""

    req: Request
    tokens: list[int]  # prompt + output so far
    generator: torch.Generator | None
    constraint: Constraint | None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in pages
    node: Node | None = None  # locked end of the cached prefix
    num_tree_pages: int = 0
    reported: bool = False
    cached_prompt_tokens: int = 0
    draft_misses: int = 0  # drafts in a row with nothing accepted
    draft_cooldown: int = 0  # steps to decode without drafting
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # gathered while the prompt prefills
    finish_reason: FinishReason | None = None  # set by the output processor; the scheduler then drops it

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own logprobs are asked for and not sent yet: its prefill needs every position's
        logits, so it skips the radix cache's match (a cached prefix's logits were never kept)."""
        return self.req.params.prompt_logprobs is not None and not self.reported

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ScheduledSeq:
    """One request's share of a step: a prefill chunk of ``num_tokens``, one decode token, or a decode token
    followed by ``draft`` tokens to verify."""

    seq: Seq
    num_tokens: int
    draft: list[int] = field(default_factory=list)
    prefill: bool = False
    prompt_rows: int = 0  # leading logits rows that score prompt tokens (set when the scheduler makes the chunk)
