"""The cache-aware scheduler of engine_prefix (satisfies engine_core.scheduler_protocol.Scheduler).

Page ownership: a running request's page table is ``pages``; ``pages[:num_tree_pages]`` belong to the radix
tree and are held by a lock on ``node``; the rest are private to the request. Whenever a prefill chunk
ends, the request's computed whole pages are inserted into the tree and its lock moves down to the new end
(a later request with the same prefix hits it at once, even mid-prefill). When a request finishes, its prompt
and output are inserted the same way; then its private tail is freed and its lock dropped.

Each step: (1) running requests decode one token (or verify an n-gram draft); when pages run out, the
cache evicts, and if that is not enough the request with the fewest generated tokens is retracted: its
computed pages go to the cache, it rejoins the queue's head and resumes later (mostly from cache). A lone
request that cannot fit ends with CapacityError. (2) Chunked prefills continue. (3) Waiting requests are
admitted in policy order (policy.py) while the token budget lasts and the pages of the chunk plus a
reservation for decoding fit: the reservation is ``new_token_ratio`` x tokens still to generate, an
adaptive estimate that decays while nothing is retracted and jumps after a retraction.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from duet.engine_config import ENGINE_DEFAULTS
from engine_core.errors import CapacityError, InvalidRequestError
from engine_core.request import FinishReason, KvEvent, LoadStats, Request, StepOutput
from engine_core.sampler import Sampler, SampleRow, prompt_logprobs
from engine_prefix import speculative
from engine_prefix.admission import schedule_step
from engine_prefix.kv_events import KvEventRecorder
from engine_prefix.policy import Candidate, InBatchDedup, Policy, order
from engine_prefix.radix_cache import RadixCache
from engine_prefix.sequence import Entry, PrefixBatch, Seq
from engine_prefix.structured import GrammarCache, apply_masks, constraint_key


@dataclass(frozen=True)
class PrefixSchedulerConfig:
    page_size: int = ENGINE_DEFAULTS.page_size
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    max_model_len: int = 2048
    policy: Policy = Policy.LPM
    fcfs_fallback_queue: int = 128
    dedup_min_tokens: int = 32
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    speculative: speculative.NgramConfig | None = None
    protect_reused: bool = False  # radix_cache.py: evict never-reused prefixes before reused ones
    aging_s: float = 0.0  # policy.py: a request waiting this long goes ahead of the cache-aware order


class PrefixScheduler:
    def __init__(self, config: PrefixSchedulerConfig, allocator, sampler: Sampler, *, model_id: str,
                 vocab_size: int, eos_token_ids: tuple[int, ...], grammars: GrammarCache | None = None,
                 hash_block_size: int = 16) -> None:
        self.config = config
        self.allocator = allocator
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars
        self.events = KvEventRecorder(model_id, hash_block_size)
        self.cache = RadixCache(allocator, config.page_size, listener=self.events,
                                protect_reused=config.protect_reused)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._outputs: list[StepOutput] = []
        self.started: list[str] = []  # request ids admitted since take_started (engine_prefix.admission appends)
        self.new_token_ratio = config.init_new_token_ratio
        self.num_preemptions = 0
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.prefill_tokens = 0  # tokens actually computed by prefill chunks (the benchmark's numerator)

    # ---- protocol: admission -------------------------------------------------------------------------------

    def validate(self, request: Request) -> None:
        p, n = request.params, len(request.prompt_token_ids)
        if n >= self.config.max_model_len:
            raise InvalidRequestError(f"the prompt has {n} tokens but this model's context is "
                                      f"{self.config.max_model_len} tokens; shorten it")
        if p.n != 1 or p.beam_width != 1:
            raise InvalidRequestError("engine_prefix serves one output per request (n=1, beam_width=1); "
                                      "send n>1 and beam search to the paged engine")
        if p.speculative and self.config.speculative is None:
            raise InvalidRequestError("speculative decoding was asked for, but this worker runs without it "
                                      "(start it with --speculative ngram, or leave 'speculative' unset)")
        key = constraint_key(p.json_schema, p.json_object, p.regex)
        if key is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured output is not available on this worker")
            if p.min_tokens:  # a complete grammar allows only EOS, which min_tokens forbids: no token left
                raise InvalidRequestError("min_tokens cannot be combined with json_schema, json_object or regex")
            self.grammars.get(key)  # compiles (once) now: a bad schema fails here, never in a step
        if -(-(n + 1) // self.config.page_size) > self.allocator.num_total:
            raise CapacityError(f"the prompt needs more than the {self.allocator.num_total} KV pages this worker has")

    def add(self, request: Request) -> None:
        key = constraint_key(request.params.json_schema, request.params.json_object, request.params.regex)
        constraint = self.grammars.constraint(key) if key is not None and self.grammars is not None else None
        self.waiting.append(Seq(request, list(request.prompt_token_ids), self.sampler.make_generator(request.params.seed),
                                 constraint))

    def abort(self, request_id: str) -> bool:
        for seq in self.waiting:
            if seq.req.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for seq in self.running:
            if seq.req.request_id == request_id:
                self.running.remove(seq)
                self._release(seq, cache=False)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_outputs(self) -> list[StepOutput]:
        out, self._outputs = self._outputs, []
        return out

    def take_started(self) -> list[str]:
        out, self.started = self.started, []
        return out

    def take_kv_events(self) -> list[KvEvent]:
        return self.events.take()

    def load(self) -> LoadStats:
        total = self.allocator.num_total
        return LoadStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_pages_used=total - self.allocator.num_free - self.cache.evictable_pages, kv_pages_total=total,
            prefix_cache_queries_tokens=self.queries_tokens, prefix_cache_hits_tokens=self.hits_tokens,
            num_preemptions=self.num_preemptions, spec_draft_tokens=self.draft_tokens,
            spec_accepted_tokens=self.accepted_tokens, reused_pages_evicted=self.cache.reused_pages_evicted)

    def private_pages(self) -> list[int]:
        return [p for s in self.running for p in s.pages[s.num_tree_pages :]]

    def check_integrity(self) -> None:
        """free + evictable + protected + private == total, every page owned once (tests call this)."""
        self.cache.check_integrity(self.private_pages())

    # ---- protocol: one step --------------------------------------------------------------------------------

    def schedule(self) -> PrefixBatch | None:
        return schedule_step(self)

    def process(self, batch: PrefixBatch, logits: torch.Tensor) -> list[StepOutput]:
        row = 0
        sampled: list[tuple[Seq, int]] = []
        drafted: list[tuple[Entry, int]] = []
        for e in batch.entries:
            seq = e.seq
            if e.prompt_rows:
                first = seq.num_computed + 1  # the row at position p scores prompt token p + 1
                seq.prompt_logprobs += prompt_logprobs(logits[row:row + e.prompt_rows],
                                                       seq.tokens[first:first + e.prompt_rows],
                                                       seq.req.params.prompt_logprobs)
                row += e.prompt_rows
            if e.prefill:
                self.prefill_tokens += e.num_tokens
                seq.num_computed += e.num_tokens
                self._cache_prefix(seq)
                if seq.num_computed == len(seq.tokens):
                    sampled.append((seq, row))
                    row += 1
            elif e.draft:
                drafted.append((e, row))
                row += len(e.draft) + 1
            else:
                seq.num_computed += 1
                sampled.append((seq, row))
                row += 1
        outputs: list[StepOutput] = []
        if sampled:
            sub = logits[[r for _, r in sampled]].float()
            apply_masks(sub, [(i, s.constraint) for i, (s, _) in enumerate(sampled) if s.constraint is not None])
            rows = [SampleRow(s.req.params, s.req.prompt_token_ids, s.output, s.generator) for s, _ in sampled]
            result = self.sampler.sample(sub, rows)
            for (seq, _), token, logprob in zip(sampled, result.token_ids, result.logprobs):
                outputs.append(self._append(seq, [token], [logprob] if logprob is not None else None))
        for e, r in drafted:
            accepted = speculative.accept_greedy(e.draft, logits[r : r + len(e.draft) + 1])
            self.draft_tokens += len(e.draft)
            self.accepted_tokens += len(accepted) - 1
            seq = e.seq
            if len(accepted) == 1:  # back off exponentially while drafts miss; greedy output is unaffected
                seq.draft_misses += 1
                seq.draft_cooldown = min(2 ** seq.draft_misses, 32)
            else:
                seq.draft_misses = 0
            e.seq.num_computed += len(accepted)  # the last token and the accepted drafts now have KV
            outputs.append(self._append(e.seq, accepted, None))
        return outputs

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    def _append(self, seq: Seq, tokens: list[int], logprobs) -> StepOutput:
        p = seq.req.params
        new: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            seq.tokens.append(token)
            new.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            if seq.constraint is not None and seq.constraint.terminated:
                reason = FinishReason.STOP
            else:
                rule = p.finish_reason(seq.output, self.eos_token_ids, max_model_len=self.config.max_model_len,
                                       num_prompt_tokens=seq.num_prompt)
                reason = None if rule is None else FinishReason(rule)
            if reason is not None:
                break
        out = StepOutput(seq.req.request_id, 0, new, logprobs=logprobs, finish_reason=reason)
        self._stamp(seq, out)
        if reason is not None:
            self.running.remove(seq)
            self._release(seq, cache=True)
        return out

    def _stamp(self, seq: Seq, out: StepOutput) -> None:
        if not seq.reported:
            seq.reported = True
            out.prompt_tokens = seq.num_prompt
            out.cached_tokens = seq.cached_prompt_tokens
            if seq.req.params.prompt_logprobs is not None:
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []

    def _cache_prefix(self, seq: Seq) -> None:
        """Insert the computed whole pages into the tree and move the lock to their end."""
        n_pages = seq.num_computed // self.config.page_size
        if n_pages <= seq.num_tree_pages:
            return
        length = n_pages * self.config.page_size
        res = self.cache.insert(seq.tokens[:length], seq.pages[:n_pages], seq.req.cache_salt)
        self.allocator.free(res.duplicate_pages)
        match = self.cache.match_prefix(seq.tokens[:length], seq.req.cache_salt)
        assert match.length == length
        seq.pages[:n_pages] = match.pages  # duplicates replaced by the tree's identical pages
        self.cache.lock(match.node)
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.node, seq.num_tree_pages = match.node, n_pages

    def _release(self, seq: Seq, cache: bool) -> None:
        """Give up every page: cache the computed whole pages (if ``cache``), free the private rest."""
        if cache:
            self._cache_prefix(seq)
        self.allocator.free(seq.pages[seq.num_tree_pages :])
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = [], None, 0, 0

    def retract(self, seq: Seq) -> None:
        """Back to the head of the queue; its computed pages stay in the cache for its return."""
        self.running.remove(seq)
        self._release(seq, cache=True)
        if seq.scores_prompt:
            seq.prompt_logprobs = []  # scored again as the prompt is recomputed
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)

    def fail(self, seq: Seq, message: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq, cache=False)
        out = StepOutput(seq.req.request_id, 0, [], finish_reason=FinishReason.ERROR, error=CapacityError(message))
        self._stamp(seq, out)
        self._outputs.append(out)

    def alloc_until(self, seq: Seq, num_tokens: int) -> bool:
        """Grow ``seq.pages`` to hold ``num_tokens`` tokens, evicting cached pages if needed."""
        need = -(-num_tokens // self.config.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        if self.allocator.num_free < need:
            return False
        seq.pages.extend(self.allocator.alloc(need))
        return True

    def candidate(self, seq: Seq, match: bool) -> Candidate:
        if not match:
            return Candidate(seq, 0, None, seq.req.priority, seq.req.arrival_time)
        m = self.cache.match_prefix(seq.tokens[:-1], seq.req.cache_salt)
        return Candidate(seq, m.length, m.node, seq.req.priority, seq.req.arrival_time)

    def ordered_waiting(self) -> list[Candidate]:
        long_queue = len(self.waiting) > self.config.fcfs_fallback_queue
        policy = Policy.FCFS if long_queue else self.config.policy
        return order([self.candidate(s, policy is not Policy.FCFS) for s in self.waiting], policy,
                     now=time.monotonic(), aging_s=self.config.aging_s)

    def new_dedup(self) -> InBatchDedup:
        return InBatchDedup(self.config.page_size, self.config.dedup_min_tokens)
