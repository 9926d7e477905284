"""The serving-side data types every engine shares: what comes in (`Request`), what goes out
(`StepOutput`, one message of one output index; its finish reason is a duet.contract.FinishReason), and what
the engine reports (`LoadStats`, `EngineSpec`, `KvEvent`).

Plain dataclasses: the servicer converts protobuf to these at the boundary (`engine_core.servicer`),
so schedulers never see protobuf. Token ids only; text lives in the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from duet.contract import FinishReason

if TYPE_CHECKING:
    from engine_core.sampling_params import SamplingParams


@dataclass
class Request:
    """One Generate call. `params` is already validated (SamplingParams.validate)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    priority: int = 0  # lower runs first when the scheduler uses priorities
    report_started: bool = False  # stream a `started` StepOutput each time it leaves the queue
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) alternatives, best first


@dataclass
class StepOutput:
    """New tokens of one output index of one request, produced by one engine step.

    `replaces_previous`: token_ids hold the WHOLE output of this index (beam search sends each
    finished beam this way). `prompt_tokens`/`cached_tokens` are set on the first message of a
    request only, as are `prompt_logprobs` (with params.prompt_logprobs: one per prompt token from the
    second on). `finish_reason` set means this index is done; when every index of a request is
    done the request is done. FinishReason.ERROR carries a human-readable `error`. `started` marks a
    progress message (no tokens) for callers that asked (`Request.report_started`): the request
    left the queue.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    replaces_previous: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    error: Exception | None = None
    started: bool = False  # a progress message, no tokens: the request left the queue (prefill begins)


@dataclass(frozen=True)
class LoadStats:
    """A snapshot for GetLoad and the metrics gauges; counters are totals since start."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    num_preemptions: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # cached KV pages evicted after some later request had hit them (a reused prefix lost, not a one-shot one)
    reused_pages_evicted: int = 0


@dataclass(frozen=True)
class EngineSpec:
    """What GetInfo reports; fixed once the worker has loaded."""

    engine_kind: str  # duet.contract.PAGED | PREFIX
    model_id: str
    version: str
    page_size: int
    max_model_len: int
    capabilities: tuple[str, ...]  # duet.contract.Capability names
    kv_capacity_tokens: int
    kv_total_pages: int
    vocab_size: int
    worker_id: str
    hash_block_size: int = 0


@dataclass(frozen=True)
class KvEvent:
    """Prefix blocks stored in / evicted from an engine's cache (chained duet.hashing hashes)."""

    kind: str  # "stored" | "evicted" | "cleared"
    block_hashes: tuple[int, ...] = ()
    parent_hash: int = 0  # stored: hash of the block before the first one here (0 at the root)
