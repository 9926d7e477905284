"""N-gram (prompt lookup) speculative decoding.

Drafting: the last n tokens of a request's context (prompt + output), n from ``max_ngram`` down to
``min_ngram``, are looked up at their most recent earlier occurrence; the up-to-k tokens that followed it
there are the draft. Workloads that copy from their prompt (editing, summarizing with quotes, code changes)
hit often; others get no draft and decode as usual.

Verification: the scheduler runs [last token, d_1 .. d_k] as one chunk with logits at every position
(ModelRunner computes logits at several positions of one chunk), so the target model's choice after each
prefix comes from a single forward pass. ``accept_greedy`` keeps the longest run of drafts that equal the
target's choices, plus the target's own next token: greedy output is token-identical to plain decoding.

Back-off: a request whose draft was wholly rejected skips drafting for 2, 4, 8 .. 32 steps (reset by any
accepted draft), so text that does not repeat costs almost nothing extra; output is unaffected.

Which requests draft: greedy ones (temperature 0) without penalties, logit bias, logprobs, min_tokens or a
grammar constraint. Sampled requests are not drafted (exact rejection sampling would need the draft's distribution,
which prompt lookup does not have; a point-mass draft makes it ordinary sampling per position, so drafting
them would buy little and risk subtle bias) — they decode one token per step, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.sampler import greedy_ids
from engine_core.sampling_params import SamplingParams


@dataclass(frozen=True)
class NgramConfig:
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    max_lookback: int = 4096  # search only this many recent tokens: drafting stays O(lookback) per step

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


def can_draft(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when verifying by argmax reproduces what the sampler would pick (see the module docstring)."""
    return (
        params.speculative is not False  # the request turned it off
        and params.temperature == 0.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and params.logprobs is None
        and num_output_tokens >= params.min_tokens
        and params.json_schema is None
        and not params.json_object
        and params.regex is None
    )


def propose(context: Sequence[int], config: NgramConfig, limit: int) -> list[int]:
    """Up to min(k, limit) tokens that followed the latest earlier occurrence of the context's tail."""
    k = min(config.num_draft_tokens, limit)
    if k <= 0:
        return []
    start = max(0, len(context) - config.max_lookback)
    window = list(context[start:])
    n_len = len(window)
    for n in range(min(config.max_ngram, n_len - 1), config.min_ngram - 1, -1):
        tail = window[n_len - n :]
        # scan right to left: the most recent occurrence predicts best (the text being copied right now)
        for i in range(n_len - n - 1, -1, -1):
            if window[i : i + n] == tail:
                draft = window[i + n : i + n + k]
                if draft:
                    return draft
    return []


def accept_greedy(draft: Sequence[int], logits: torch.Tensor) -> list[int]:
    """Tokens to append: the drafts the target agrees with, then the target's next token.

    ``logits``: [len(draft) + 1, V], row j = the target's distribution after the last token and drafts[:j]."""
    targets = greedy_ids(logits).tolist()
    out: list[int] = []
    for j, d in enumerate(draft):
        if targets[j] != d:
            break
        out.append(d)
    out.append(targets[len(out)])
    return out
