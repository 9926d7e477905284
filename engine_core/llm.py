"""The offline API, as vLLM users know it:

    from engine_core import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", device="cpu")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids

generate() validates every prompt and params first (InvalidRequestError before any work), then runs all of them
together through `EngineCore` over engine_paged's scheduler: continuous batching, chunked prefill, preemption when
pages run out, n > 1 by forking, beam search, and the paged engine's prefix cache (on by default).

Layering: engine_core is the layer below the engine kinds and never imports one at module level (a test checks
it). The offline LLM is the one facade that sits above them; it lives here only so that
`from engine_core import LLM` works as in vLLM, and it builds engine_paged's scheduler through one lazy import
in `_paged_scheduler`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from duet.contract import FinishReason
from duet.engine_config import ENGINE_DEFAULTS, EngineConfig, PagedConfig
from engine_core.builder import build_runtime, new_pool, resolve_device
from engine_core.engine_core import EngineCore
from engine_core.errors import CapacityError, InvalidRequestError
from engine_core.kv_pool import KVPool, pages_for_budget, torch_dtype
from engine_core.request import Request, StepOutput, TokenLogprob
from engine_core.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length"
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class LLM:
    def __init__(self, model_dir, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 page_size: int = ENGINE_DEFAULTS.page_size, kv_cache_tokens: int | None = None,
                 max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens,
                 max_model_len: int | None = None, seed: int | None = None, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = True, quantization: str = "none", compile: bool | None = None):
        """model_dir: a checkpoint path or a duet.model_dir.ModelDir. kv_cache_tokens None sizes the KV pool
        to each generate() call; a number fixes it (requests then wait for pages, or are preempted)."""
        from duet.model_dir import ModelDir, read_model_dir

        self.model_dir = model_dir if isinstance(model_dir, ModelDir) else read_model_dir(model_dir)
        self.config = self.model_dir.config
        self.device = resolve_device(device)
        self.dtype = torch_dtype(dtype or self.config.dtype)
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self._fixed_pool = kv_cache_tokens is not None
        num_pages = pages_for_budget(self.config, page_size, kv_cache_tokens=kv_cache_tokens or page_size)
        runtime = build_runtime(self.model_dir, device=self.device, page_size=page_size, num_pages=num_pages,
                                dtype=self.dtype, seed=seed, quantization=quantization,
                                compile=compile)
        self.runner, self.sampler = runtime.runner, runtime.sampler
        self.scheduler = self._paged_scheduler(num_pages)
        self.core = EngineCore(self.scheduler, self.runner)
        self.tokenizer = _load_tokenizer(self.model_dir.path)
        self._ids = itertools.count()

    @property
    def block_manager(self):
        """The paged scheduler's engine_paged.block_manager.BlockManager (pages, reference counts, cache)."""
        return self.scheduler.bm

    def _new_pool(self, num_pages: int) -> KVPool:
        return new_pool(self.model_dir, num_pages, self.page_size, self.device, self.dtype)

    def _paged_scheduler(self, num_pages: int):
        # the one upward import of engine_core (see the module docstring): lazy, so no import cycle
        from engine_paged.worker import build_scheduler

        engine = EngineConfig(page_size=self.page_size, max_num_seqs=self.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens)
        return build_scheduler(PagedConfig(engine, enable_prefix_caching=self.enable_prefix_caching),
                               self.runner.kv_pool, self.sampler, max_model_len=self.max_model_len,
                               eos_token_ids=tuple(self.config.eos_token_ids), vocab_size=self.config.vocab_size,
                               model_id=self.model_dir.model_id, watermark=0.0)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Per prompt (a string or a list of token ids), a RequestOutput with params.n completions."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_per_prompt(prompts, params)
        prompt_ids = [self._prompt_token_ids(p) for p in prompts]
        for ids, p in zip(prompt_ids, params_list):
            self._validate(ids, p)
        self._reserve_pool(prompt_ids, params_list)
        requests = [Request(f"llm-{next(self._ids)}", ids, p) for ids, p in zip(prompt_ids, params_list)]
        for r in requests:
            self.scheduler.validate(r)  # all of them before any is queued
        results = self._run(requests)
        return [RequestOutput(prompt if isinstance(prompt, str) else None, r.prompt_token_ids,
                              [self._completion(r.params, results[r.request_id], i) for i in range(r.params.n)],
                              results[r.request_id].cached_tokens)
                for prompt, r in zip(prompts, requests)]

    # -- input checks (all before any work) --

    def _params_per_prompt(self, prompts, params) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                      "pass one for all or one per prompt")
        return list(params)

    def _prompt_token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.model_dir.path} has no tokenizer; pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens but this model's context is "
                                      f"{self.max_model_len} tokens, which leaves no room to generate; shorten it")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside this model's vocabulary "
                                      f"(0..{self.config.vocab_size - 1})")
        params.validate(self.config.vocab_size)
        total = self.block_manager.num_total_pages
        if self._fixed_pool and self._pages_needed(ids, params) > total:
            raise CapacityError(f"the prompt plus max_tokens needs {self._pages_needed(ids, params)} KV pages, "
                                f"more than the {total} this LLM holds")

    def _pages_needed(self, ids: list[int], params: SamplingParams) -> int:
        return -(-min(len(ids) + params.max_tokens, self.max_model_len) // self.page_size)

    def _reserve_pool(self, prompt_ids: list[list[int]], params_list: list[SamplingParams]) -> None:
        # unbounded mode: one pool that holds the whole call, grown (never shrunk) as calls need; each of
        # n outputs or beams may need its own pages, plus one copy-on-write page each
        needed = sum(max(p.n, p.beam_width) * (self._pages_needed(ids, p) + 1)
                     for ids, p in zip(prompt_ids, params_list))
        if not self._fixed_pool and needed > self.block_manager.num_total_pages:
            self.runner.kv_pool = self._new_pool(needed)
            self.scheduler = self._paged_scheduler(needed)
            self.core = EngineCore(self.scheduler, self.runner)

    # -- the step loop: EngineCore over the paged scheduler --

    def _run(self, requests: list[Request]) -> dict[str, _Collected]:
        results = {r.request_id: _Collected() for r in requests}
        for r in requests:
            self.scheduler.add(r)
        try:
            while self.core.has_unfinished():
                for out in self.core.step().outputs:
                    if out.finish_reason is FinishReason.ERROR:
                        raise out.error or CapacityError("the engine failed this request")
                    results[out.request_id].add(out)
        finally:
            for r in requests:  # an error ends the call: nothing of it stays queued or holds pages
                self.core.abort(r.request_id)
        return results

    def _completion(self, params: SamplingParams, collected: _Collected, index: int) -> CompletionOutput:
        tokens = collected.tokens.get(index, [])
        logprobs = collected.logprobs.get(index, [])
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        wants = params.logprobs is not None
        reason = collected.finish.get(index)
        cumulative = collected.cumulative.get(index) if wants or params.beam_width > 1 else None
        return CompletionOutput(index, tokens, text, logprobs if wants else None,
                                None if reason is None else reason.value, cumulative)


class _Collected:
    """One request's stream folded into whole outputs (a beam's whole output replaces what came before)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}
        self.finish: dict[int, FinishReason] = {}
        self.cumulative: dict[int, float] = {}
        self.cached_tokens = 0

    def add(self, out: StepOutput) -> None:
        if out.replaces_previous:
            self.tokens[out.index] = list(out.token_ids)
            self.logprobs[out.index] = list(out.logprobs or [])
        else:
            self.tokens.setdefault(out.index, []).extend(out.token_ids)
            self.logprobs.setdefault(out.index, []).extend(out.logprobs or [])
        if out.cached_tokens:
            self.cached_tokens = out.cached_tokens
        if out.cumulative_logprob is not None:
            self.cumulative[out.index] = out.cumulative_logprob
        if out.finish_reason is not None:
            self.finish[out.index] = out.finish_reason


def _load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when the directory has none (token-id prompts still work)."""
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    from duet.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)
