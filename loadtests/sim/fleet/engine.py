"""One simulated worker: the REAL scheduler of its kind driven by the real `EngineCore`, with the model runner
replaced by `CostRunner`, which returns cheap logits and advances a virtual clock by the step's modelled cost.

- engine_paged: `engine_paged.worker.build_scheduler` (its BlockManager, automatic prefix cache, FCFS
  chunked-prefill admission, preemption by recompute), exactly as `duet engine paged` builds it.
- engine_prefix: `engine_prefix.scheduler.PrefixScheduler` (its RadixCache, LPM admission, retraction),
  with the parameters `engine_prefix.worker.build_engine` passes.

The runner's logits are [rows, VOCAB] zeros with one hot column, so the real `Sampler` (greedy: argmax) picks
`OUTPUT_TOKEN` every time: the sampling path, stop rule and output processing all run for real, on a
vocabulary small enough that a step's logits cost nothing. Requests use `ignore_eos` and `max_tokens` from
the trace. No KV tensors exist: the pool is a `PagePool`, page bookkeeping only (copy-on-write is a no-op,
since no KV is stored). `EngineProfile` is the deployment both kinds share (the KV budget, batch limits and
context length of the hardware the cost model describes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duet.engine_config import ENGINE_DEFAULTS
from duet.launcher import EngineLimits
from engine_core.engine_core import EngineCore, StepResult
from engine_core.kv_pool import PageAllocator
from engine_core.request import Request
from engine_core.sampler import Sampler
from engine_core.sampling_params import SamplingParams
from loadtests.sim.fleet.cost_models import shape_of

VOCAB = 256  # token ids stay small ints (cached by CPython); prompts use ids 1..255
EOS = 0
OUTPUT_TOKEN = VOCAB - 1
MODEL_ID = "fleet-sim"
PREFIX_HASH_BLOCK = 16  # engine_prefix.worker.HASH_BLOCK_SIZE


@dataclass(frozen=True)
class EngineProfile:
    """What every simulated worker gets (both kinds alike, as the benchmarks give real workers)."""

    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int = ENGINE_DEFAULTS.page_size
    prefix_policy: str = "lpm"  # engine_prefix's default --schedule-policy
    paged_prefix_caching: bool = True

    @classmethod
    def for_cost_model(cls, name: str) -> EngineProfile:
        if name == "h200":
            # Llama-3.1-8B bf16 on one H200: ~100 GiB of the 141 GB left for KV at 128 KiB a token; batch limits
            # as a GPU deployment sets them (vLLM's defaults on a large GPU)
            return cls(kv_cache_tokens=819_200, max_num_seqs=256, max_num_batched_tokens=8192,
                       max_model_len=131_072)
        if name == "h200-70b":
            # Llama-3.1-70B FP8 on one H200: 141 GB less 69.6 GB of weights and ~10 GB of activations and graphs
            # leave ~60 GB, 180k tokens at 320 KiB a token: a fifth of the 8B model's KV per worker
            return cls(kv_cache_tokens=180_000, max_num_seqs=256, max_num_batched_tokens=8192,
                       max_model_len=131_072)
        limits = EngineLimits(kv_cache_tokens=4096)  # what the local stack's workers get (duet bench compare)
        return cls(kv_cache_tokens=limits.kv_cache_tokens, max_num_seqs=limits.max_num_seqs,
                   max_num_batched_tokens=limits.max_num_batched_tokens, max_model_len=8192,
                   page_size=limits.page_size)


@dataclass
class PagePool:
    """The part of engine_core.kv_pool.KVPool a scheduler reads, without the KV tensors."""

    num_pages: int
    page_size: int

    def copy_pages(self, pairs) -> None:
        pass  # no KV is stored: copy-on-write has nothing to copy


class CostRunner:
    """`engine_core.scheduler_protocol.Runner`: one-hot logits, and the step's modelled seconds on `clock`."""

    def __init__(self, cost_model) -> None:
        self.cost_model = cost_model
        self.clock = 0.0  # virtual seconds of model time so far
        self.last_step_s = 0.0
        self.steps = 0
        self._hot = torch.zeros(1, VOCAB)
        self._hot[0, OUTPUT_TOKEN] = 1.0

    def forward(self, chunks) -> torch.Tensor:
        shape = shape_of(chunks)
        self.last_step_s = self.cost_model.step_seconds(shape)
        self.clock += self.last_step_s
        self.steps += 1
        return self._hot.expand(shape.rows, VOCAB)


def build_scheduler(kind: str, profile: EngineProfile, seed: int = 0):
    sampler = Sampler(VOCAB, (EOS,), "cpu", seed)
    num_pages = -(-profile.kv_cache_tokens // profile.page_size)
    if kind == "paged":
        from engine_paged.worker import build_scheduler as paged_scheduler

        return paged_scheduler(PagePool(num_pages, profile.page_size), sampler, max_model_len=profile.max_model_len,
                               eos_token_ids=(EOS,), vocab_size=VOCAB, model_id=MODEL_ID,
                               max_num_seqs=profile.max_num_seqs,
                               max_num_batched_tokens=profile.max_num_batched_tokens,
                               enable_prefix_caching=profile.paged_prefix_caching)
    if kind == "prefix":
        from engine_prefix.policy import Policy
        from engine_prefix.scheduler import PrefixScheduler, PrefixSchedulerConfig

        config = PrefixSchedulerConfig(page_size=profile.page_size, max_num_seqs=profile.max_num_seqs,
                                       max_num_batched_tokens=profile.max_num_batched_tokens,
                                       max_model_len=profile.max_model_len, policy=Policy.parse(profile.prefix_policy))
        return PrefixScheduler(config, PageAllocator(num_pages), sampler, model_id=MODEL_ID, vocab_size=VOCAB,
                               eos_token_ids=(EOS,), hash_block_size=PREFIX_HASH_BLOCK)
    raise ValueError(f"unknown engine kind {kind!r}; expected paged or prefix")


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id, prompt, params, arrival_time=0.0)


@dataclass
class SimEngine:
    """A worker: `core` (the real EngineCore over the real scheduler) and its cost runner."""

    worker_id: str
    kind: str
    core: EngineCore
    runner: CostRunner
    step_log: list[tuple[int, int, int]] | None = None  # (prefill, decode, preemptions) per step, when kept
    busy_until: float = 0.0  # virtual time the step in flight ends
    stepping: bool = False
    draining: bool = False
    pending: StepResult | None = field(default=None, repr=False)  # the in-flight step's result, delivered at its end

    @classmethod
    def build(cls, worker_id: str, kind: str, profile: EngineProfile, cost_model, keep_log: bool = False) -> SimEngine:
        runner = CostRunner(cost_model)
        return cls(worker_id, kind, EngineCore(build_scheduler(kind, profile), runner), runner,
                   [] if keep_log else None)

    def step(self) -> tuple[StepResult, float]:
        """Run one real step; (its result, its modelled seconds; 0 when no model ran)."""
        result = self.core.step()
        seconds = self.runner.last_step_s if result.ran_model else 0.0
        if self.step_log is not None and result.ran_model:
            self.step_log.append((result.prefill_tokens, result.decode_tokens, self.core.scheduler.load().num_preemptions))
        return result, seconds
