"""One simulated worker: the REAL scheduler of its kind driven by the real `EngineCore`, with the model runner
replaced by `CostRunner`, which returns cheap logits and advances a virtual clock by the step's modelled cost.

Each kind's scheduler is built by its worker's own builder (`engine_paged.worker.build_scheduler`,
`engine_prefix.worker.build_scheduler`) from `worker_config`: the worker's default config (`duet engine
paged|prefix` with no flags) given only the deployment's KV budget, batch limits and page size, on the deployment's
device (engine_paged's prefill cap while decoding is the device's default). So engine_prefix runs reuse-aware
eviction and 2 s aging as a worker does, and a test (tests/loadtests/test_fleet_engine.py)
fails if a simulated scheduler's settings ever differ from the worker's defaults. Scheduler time is the
engine's clock, here the simulation's virtual time (`SimEngine.build(clock=...)`), and a request's
`arrival_time` is when it reached the worker on that clock, so aging runs under virtual time as it does live.

The runner's logits are [rows, VOCAB] zeros with one hot column, so the real `Sampler` (greedy: argmax) picks
`OUTPUT_TOKEN` every time: the sampling path, stop rule and output processing all run for real, on a
vocabulary small enough that a step's logits cost nothing. Requests use `ignore_eos` and `max_tokens` from
the trace, and turn n-gram drafting off (`speculative=False`; the worker's drafter stays configured): an output
of one token repeated is text prompt lookup would always guess, which no real answer is, and the cost models
price a step by its tokens, not by drafts accepted. No KV tensors exist: the pool is a `PagePool`, page
bookkeeping only (copy-on-write is a no-op, since no KV is stored). `EngineProfile` is the deployment both
kinds share (the KV budget, batch limits and context length of the hardware the cost model describes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from duet.contract import PAGED, PREFIX
from duet.engine_config import ENGINE_DEFAULTS, EngineConfig, PagedConfig, PrefixConfig
from duet.launcher import EngineLimits
from engine_core.engine_core import EngineCore, StepResult
from engine_core.request import Request
from engine_core.sampler import Sampler
from engine_core.sampling_params import SamplingParams
from engine_core.step_rates import StepRates
from loadtests.sim.fleet.cost_models import shape_of

VOCAB = 256  # token ids stay small ints (cached by CPython); prompts use ids 1..255
EOS = 0
OUTPUT_TOKEN = VOCAB - 1
MODEL_ID = "fleet-sim"


@dataclass(frozen=True)
class EngineProfile:
    """What every simulated worker gets (both kinds alike, as the benchmarks give real workers)."""

    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int = ENGINE_DEFAULTS.page_size
    device: str = "cpu"  # what the deployment runs on: it picks the defaults a worker takes from its device
    # engine_paged's cap on a decoding step's prompt tokens; None: the worker's default on `device`. 0 (no cap beyond
    # max_num_batched_tokens) is vLLM's chunked prefill: decodes first, prompt chunks fill the step's token budget
    # (an external vLLM's kind simulated: loadtests/advise/calibrated.py)
    paged_prefill_cap: int | None = None

    @classmethod
    def for_cost_model(cls, name: str) -> EngineProfile:
        if name == "h200":
            # Llama-3.1-8B bf16 on one H200: ~100 GiB of the 141 GB left for KV at 128 KiB a token; batch limits
            # as a GPU deployment sets them (vLLM's defaults on a large GPU)
            return cls(kv_cache_tokens=819_200, max_num_seqs=256, max_num_batched_tokens=8192,
                       max_model_len=131_072, device="cuda")
        if name == "h200-70b":
            # Llama-3.1-70B FP8 on one H200: 141 GB less 69.6 GB of weights and ~10 GB of activations and graphs
            # leave ~60 GB, 180k tokens at 320 KiB a token: a fifth of the 8B model's KV per worker
            return cls(kv_cache_tokens=180_000, max_num_seqs=256, max_num_batched_tokens=8192,
                       max_model_len=131_072, device="cuda")
        limits = EngineLimits(kv_cache_tokens=4096)  # what the local stack's workers get (duet bench compare)
        return cls(kv_cache_tokens=limits.kv_cache_tokens, max_num_seqs=limits.max_num_seqs,
                   max_num_batched_tokens=limits.max_num_batched_tokens, max_model_len=8192,
                   page_size=limits.page_size)


@dataclass
class PagePool:
    """The part of engine_core.kv_pool.KVPool a scheduler reads, without the KV tensors."""

    num_pages: int
    page_size: int
    device: str = "cpu"  # the modelled deployment's (engine_paged's builder reads it for its device defaults)

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


def worker_config(kind: str, profile: EngineProfile) -> PagedConfig | PrefixConfig:
    """What `duet engine KIND` is started with on this deployment: its KV budget, batch limits and page size;
    every other setting (schedule policy, prefix caching, eviction, aging, speculation) the worker's default."""
    engine = EngineConfig(page_size=profile.page_size, kv_cache_tokens=profile.kv_cache_tokens,
                          max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens)
    if kind == PAGED:
        return PagedConfig(engine, max_prefill_tokens_while_decoding=profile.paged_prefill_cap)
    if kind == PREFIX:
        return PrefixConfig(engine)
    raise ValueError(f"unknown engine kind {kind!r}; expected paged or prefix")


def build_scheduler(kind: str, profile: EngineProfile, seed: int = 0, clock: Callable[[], float] = time.monotonic):
    """The scheduler a `kind` worker runs on this deployment, built by the worker's own builder; `clock` is the
    engine's (the simulator passes its virtual time)."""
    config = worker_config(kind, profile)
    sampler = Sampler(VOCAB, (EOS,), "cpu", seed)
    pool = PagePool(-(-profile.kv_cache_tokens // profile.page_size), profile.page_size, profile.device)
    model = {"max_model_len": profile.max_model_len, "eos_token_ids": (EOS,), "vocab_size": VOCAB,
             "model_id": MODEL_ID}
    if kind == PAGED:
        from engine_paged.worker import build_scheduler as paged_scheduler

        return paged_scheduler(config, pool, sampler, **model)  # reads no clock
    from engine_prefix.worker import build_scheduler as prefix_scheduler

    return prefix_scheduler(config, pool, sampler, **model, clock=clock)


def make_request(request_id: str, prompt: list[int], max_tokens: int, arrival_s: float = 0.0) -> Request:
    """A trace request as it reaches the worker at `arrival_s` on the engine's clock."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculative=False)
    return Request(request_id, prompt, params, arrival_time=arrival_s)


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
    # the prefill and decode rates the worker reports in GetLoad (engine_core/step_rates.py), over modelled seconds
    rates: StepRates = field(default_factory=StepRates, repr=False)

    @classmethod
    def build(cls, worker_id: str, kind: str, profile: EngineProfile, cost_model, keep_log: bool = False, *,
              clock: Callable[[], float]) -> SimEngine:
        """`clock` is the virtual time the driver runs on: the scheduler's time (aging), and the one requests'
        `arrival_s` must be given on."""
        runner = CostRunner(cost_model)
        return cls(worker_id, kind, EngineCore(build_scheduler(kind, profile, clock=clock), runner), runner,
                   [] if keep_log else None)

    def step(self) -> tuple[StepResult, float]:
        """Run one real step; (its result, its modelled seconds; 0 when no model ran)."""
        result = self.core.step()
        seconds = self.runner.last_step_s if result.ran_model else 0.0
        self.rates.observe(seconds, result.prefill_tokens, result.decode_tokens)
        observe = getattr(self.core.scheduler, "observe_step", None)
        if observe is not None and result.ran_model:  # as the serving loop tells a real worker its step times
            observe(seconds, result.prefill_tokens, result.decode_tokens)
        if self.step_log is not None and result.ran_model:
            self.step_log.append((result.prefill_tokens, result.decode_tokens, self.core.scheduler.load().num_preemptions))
        return result, seconds
