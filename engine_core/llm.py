"""The offline API, as vLLM users know it:

    from engine_core import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", device="cpu")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids

generate() validates every prompt and params first (InvalidRequestError before any work), then runs all of them
together: each step batches the decode tokens of running sequences with prefill chunks of new ones, up to
max_num_batched_tokens, through one ModelRunner.forward. Scheduling is deliberately simple: a sequence is
admitted when pages for its whole budget (prompt + max_tokens) are free, FCFS, no preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_core.errors import CapacityError, InvalidRequestError
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool, PageAllocator, pages_for_budget, torch_dtype
from engine_core.model_runner import ModelRunner
from engine_core.request import TokenLogprob
from engine_core.sampler import Sampler, SampleRow, make_generator
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


@dataclass
class _Seq:
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int
    num_pages: int
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pages
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)


class LLM:
    def __init__(self, model_dir, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 page_size: int = 16, kv_cache_tokens: int | None = None, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, seed: int | None = None):
        """model_dir: a checkpoint path or a duet.model_dir.ModelDir. kv_cache_tokens None sizes the KV pool
        to each generate() call; a number fixes it (requests then wait for pages)."""
        from duet.model_dir import ModelDir, read_model_dir

        self.model_dir = model_dir if isinstance(model_dir, ModelDir) else read_model_dir(model_dir)
        self.config = self.model_dir.config
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype or self.config.dtype)
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self._fixed_pool = kv_cache_tokens is not None
        num_pages = pages_for_budget(self.config, page_size, kv_cache_tokens=kv_cache_tokens or page_size)
        self.runner = ModelRunner(self.model_dir, self._new_pool(num_pages), self.device, self.dtype)
        self.allocator = PageAllocator(num_pages)
        self.sampler = Sampler(self.config.vocab_size, self.config.eos_token_ids, self.device, seed)
        self.tokenizer = _load_tokenizer(self.model_dir.path)

    def _new_pool(self, num_pages: int) -> KVPool:
        c = self.config
        return KVPool(c.num_hidden_layers, num_pages, self.page_size, c.num_key_value_heads, c.head_dim,
                      self.dtype, self.device)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Per prompt (a string or a list of token ids), a RequestOutput with params.n completions."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_per_prompt(prompts, params)
        prompt_ids = [self._prompt_token_ids(p) for p in prompts]
        for ids, p in zip(prompt_ids, params_list):
            self._validate(ids, p)
        seqs_per_prompt = [[self._new_seq(ids, p, i) for i in range(p.n)] for ids, p in zip(prompt_ids, params_list)]
        seqs = [s for group in seqs_per_prompt for s in group]
        self._reserve_pool(seqs)
        self._run(seqs)
        return [RequestOutput(prompt if isinstance(prompt, str) else None, ids,
                              [self._completion(s) for s in group])
                for prompt, ids, group in zip(prompts, prompt_ids, seqs_per_prompt)]

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
        if params.beam_width > 1:
            raise InvalidRequestError("beam search is not supported by the offline LLM; use the paged engine")
        if params.json_schema is not None or params.json_object or params.regex is not None:
            raise InvalidRequestError("structured output is not supported by the offline LLM; use the prefix engine")
        if self._fixed_pool and self._pages_needed(ids, params) > self.allocator.num_total:
            raise CapacityError(f"the prompt plus max_tokens needs {self._pages_needed(ids, params)} KV pages, "
                                f"more than the {self.allocator.num_total} this LLM holds")

    def _pages_needed(self, ids: list[int], params: SamplingParams) -> int:
        return -(-min(len(ids) + params.max_tokens, self.max_model_len) // self.page_size)

    def _new_seq(self, ids: list[int], params: SamplingParams, index: int) -> _Seq:
        # sample i of n draws from seed + i: reproducible, and distinct from its siblings
        seed = None if params.seed is None else (params.seed + index) % 2**64
        return _Seq(ids, params, index, self._pages_needed(ids, params), make_generator(seed, self.device))

    def _reserve_pool(self, seqs: list[_Seq]) -> None:
        # unbounded mode: one pool that holds the whole call, grown (never shrunk) as calls need
        needed = sum(s.num_pages for s in seqs)
        if not self._fixed_pool and needed > self.allocator.num_total:
            self.runner.kv_pool = self._new_pool(needed)
            self.allocator = PageAllocator(needed)

    # -- the step loop --

    def _run(self, seqs: list[_Seq]) -> None:
        waiting, running = deque(seqs), []
        while waiting or running:
            while waiting and self.allocator.can_alloc(waiting[0].num_pages):
                seq = waiting.popleft()
                seq.pages = self.allocator.alloc(seq.num_pages)
                running.append(seq)
            chunks, stepped = self._schedule(running)
            logits = self.runner.forward(chunks)
            sampled = [s for s, c in zip(stepped, chunks) if c.logits_positions]
            rows = [SampleRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in sampled]
            out = self.sampler.sample(logits, rows)
            for seq, token, logprob in zip(sampled, out.token_ids, out.logprobs):
                self._append(seq, token, logprob)
            for seq in [s for s in running if s.finish_reason is not None]:
                running.remove(seq)
                self.allocator.free(seq.pages)
                seq.pages = []

    def _schedule(self, running: list[_Seq]) -> tuple[list[SeqChunk], list[_Seq]]:
        """Decode tokens first (one each), then prefill chunks while the token budget lasts."""
        chunks, stepped = [], []
        budget = self.max_num_batched_tokens
        for seq in running:
            if not seq.prefilling:
                chunks.append(SeqChunk([seq.output_token_ids[-1]], seq.num_computed, seq.pages))
                stepped.append(seq)
                seq.num_computed += 1
                budget -= 1
        for seq in running:
            if seq.prefilling and budget > 0:
                start = seq.num_computed
                n = min(len(seq.prompt_token_ids) - start, budget)
                last = start + n == len(seq.prompt_token_ids)
                chunks.append(SeqChunk(seq.prompt_token_ids[start:start + n], start, seq.pages,
                                       (-1,) if last else ()))
                stepped.append(seq)
                seq.num_computed += n
                budget -= n
        return chunks, stepped

    def _append(self, seq: _Seq, token: int, logprob: TokenLogprob | None) -> None:
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        seq.finish_reason = seq.params.finish_reason(seq.output_token_ids, self.config.eos_token_ids)
        if seq.finish_reason is None and len(seq.prompt_token_ids) + len(seq.output_token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    def _completion(self, seq: _Seq) -> CompletionOutput:
        text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer is not None else ""
        wants = seq.params.logprobs is not None
        return CompletionOutput(seq.index, seq.output_token_ids, text, seq.logprobs if wants else None,
                                seq.finish_reason, sum(lp.logprob for lp in seq.logprobs) if wants else None)


def _load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when the directory has none (token-id prompts still work)."""
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    from duet.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)
