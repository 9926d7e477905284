"""The cache-aware scheduler of engine_prefix (satisfies engine_core.scheduler_protocol.Scheduler).

Pages: a running request's page table starts with tree pages held by a lock, then private pages
(engine_prefix.block_manager); every finished prefill chunk is cached at once, and a finished request's prompt
and output are cached before its private tail is freed (engine_prefix.postprocess).

Each step, under the token budget (`max_num_batched_tokens`) and the sequence cap (`max_num_seqs`):
  1. running requests decode one token (or verify an n-gram draft), most generated first; when pages run out
     the cache evicts, and if that is not enough the request with the fewest generated tokens is preempted:
     its computed pages go to the cache, it rejoins the queue's head and resumes later (mostly from cache). A
     lone request that cannot fit ends with CapacityError;
  2. chunked prefills continue;
  3. waiting requests are admitted in policy order (policy.py; aging reads the scheduler's `clock`, the
     engine's: time.monotonic in a worker, virtual time in the fleet simulator) while the token budget lasts
     and the pages of the chunk plus a reservation for decoding fit. The reservation is ``new_token_ratio`` x
     tokens still to generate, an adaptive estimate that decays while nothing is preempted and jumps after a
     preemption. Nothing is admitted in a step that had to preempt.

Sampling, draft verification and stopping live in `engine_prefix.postprocess.OutputProcessor`, which this
scheduler owns (it never imports the scheduler back).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duet.contract import HASH_BLOCK_TOKENS, FinishReason
from duet.engine_config import ENGINE_DEFAULTS
from engine_core.errors import CapacityError, InvalidRequestError
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import Allocator
from engine_core.request import KvEvent, LoadStats, Request, StepOutput
from engine_core.sampler import Sampler
from engine_core.scheduler_protocol import SchedulerOutput
from engine_prefix import speculative
from engine_prefix.block_manager import BlockManager
from engine_prefix.kv_events import KvEventRecorder
from engine_prefix.policy import Candidate, InBatchDedup, Policy, order
from engine_prefix.postprocess import OutputProcessor, stamp_first
from engine_prefix.radix_cache import RadixCache
from engine_prefix.sequence import ScheduledSeq, Seq
from engine_prefix.structured import GrammarCache, constraint_key


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
    def __init__(self, config: PrefixSchedulerConfig, allocator: Allocator, sampler: Sampler, *, model_id: str,
                 vocab_size: int, eos_token_ids: tuple[int, ...], grammars: GrammarCache | None = None,
                 hash_block_size: int = HASH_BLOCK_TOKENS, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.clock = clock  # the engine's clock, the one its requests' arrival_time is on (aging compares them)
        self.events = KvEventRecorder(model_id, hash_block_size)
        self.cache = RadixCache(allocator, config.page_size, listener=self.events,
                                protect_reused=config.protect_reused)
        self.bm = BlockManager(allocator, self.cache)
        self.outputs = OutputProcessor(self.bm, sampler, eos_token_ids, config.max_model_len)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._outputs: list[StepOutput] = []
        self._started: list[str] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.num_preemptions = 0
        self.queries_tokens = 0  # prompt tokens of admitted requests ...
        self.hits_tokens = 0  # ... and how many of them the cache held
        self.prefill_tokens = 0  # tokens actually computed by prefill chunks (the benchmark's numerator)

    # ---- the protocol: requests in and out -----------------------------------------------------------------

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
        if self.bm.pages_for(n + 1) > self.bm.num_total_pages:
            raise CapacityError(f"the prompt needs more than the {self.bm.num_total_pages} KV pages this worker has")

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
                self.bm.release(seq, cache=False)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_outputs(self) -> list[StepOutput]:
        out, self._outputs = self._outputs, []
        return out

    def take_started(self) -> list[str]:
        out, self._started = self._started, []
        return out

    def take_kv_events(self) -> list[KvEvent]:
        return self.events.take()

    def load(self) -> LoadStats:
        total = self.bm.num_total_pages
        return LoadStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_pages_used=total - self.bm.num_available_pages, kv_pages_total=total,
            prefix_cache_queries_tokens=self.queries_tokens, prefix_cache_hits_tokens=self.hits_tokens,
            num_preemptions=self.num_preemptions, spec_draft_tokens=self.outputs.draft_tokens,
            spec_accepted_tokens=self.outputs.accepted_tokens, reused_pages_evicted=self.cache.reused_pages_evicted)

    def check_integrity(self) -> None:
        """free + evictable + protected + private == total, every page owned once (tests call this)."""
        self.bm.check_integrity(self.running)

    def process(self, batch: SchedulerOutput[ScheduledSeq], logits: torch.Tensor) -> list[StepOutput]:
        outputs = self.outputs.process(batch, logits)
        self.running = [s for s in self.running if not s.finished]  # their pages are already released
        return outputs

    # ---- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput[ScheduledSeq] | None:
        cfg = self.config
        entries: list[ScheduledSeq] = []
        budget = cfg.max_num_batched_tokens
        preempted = False

        # 1. decode: most generated first, so preemption victims (fewest generated) come last
        decoding = sorted((q for q in self.running if q.num_computed == len(q.tokens) - 1),
                          key=lambda q: q.num_output, reverse=True)
        for seq in decoding:
            if seq not in self.running or budget <= 0:
                continue
            draft = self._draft(seq)
            if draft and not self.bm.alloc_until(seq, len(seq.tokens) + len(draft)):
                draft = []
            while not self.bm.alloc_until(seq, len(seq.tokens)):
                victim = self._victim(exclude=[e.seq for e in entries])
                if victim is None:  # alone and still no room: it can never finish here
                    self._fail(seq, f"KV cache exhausted: request {seq.req.request_id} needs more than the "
                                    f"{self.bm.num_total_pages} pages this worker holds")
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            entries.append(ScheduledSeq(seq, 1 + len(draft), draft))
            budget -= 1 + len(draft)
        if not preempted:
            self.new_token_ratio = max(cfg.min_new_token_ratio, self.new_token_ratio - cfg.new_token_ratio_decay)

        # 2. chunked prefills already running
        for seq in [q for q in self.running if q.num_computed < len(q.tokens) - 1]:
            if budget <= 0:
                break
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self.bm.alloc_until(seq, seq.num_computed + n):
                if len(self.running) > 1:
                    self._preempt(seq)
                    preempted = True
                else:
                    self._fail(seq, f"KV cache exhausted: the prompt of {seq.req.request_id} does not fit")
                continue
            entries.append(ScheduledSeq(seq, n, prefill=True))
            budget -= n

        # 3. admit waiting requests (not in a step that had to preempt: memory is short)
        if not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            self._admit(entries, budget)

        if not entries:
            return None
        self.prefill_tokens += sum(e.num_tokens for e in entries if e.prefill)
        return SchedulerOutput([_chunk(e) for e in entries], entries)

    def _admit(self, entries: list[ScheduledSeq], budget: int) -> None:
        cfg = self.config
        dedup = InBatchDedup(cfg.page_size, cfg.dedup_min_tokens)
        for e in entries:  # chunked prefills still computing their prompt count as in this batch too
            if e.prefill:
                dedup.admit(e.seq.tokens, e.seq.req.cache_salt)
        reserved = sum(self._pages_to_go(q) for q in self.running)
        for cand in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            seq: Seq = cand.item
            salt = seq.req.cache_salt
            # fresh: an earlier admission may have evicted; none for a prompt to score (every position's logits)
            m = self.cache.match_prefix([] if seq.scores_prompt else seq.tokens[:-1], salt)
            if dedup.should_wait(seq.tokens, salt, m.length):
                continue
            self.cache.lock(m.node)
            n = min(len(seq.tokens) - m.length, budget)
            pages_now = self.bm.pages_for(m.length + n) - len(m.pages)
            own_reserve = self.bm.pages_for(len(seq.tokens) + self._decode_estimate(seq)) - len(m.pages) - pages_now
            available = self.bm.num_available_pages
            fits_now = pages_now <= available
            fits_reserve = pages_now + max(0, own_reserve) + reserved <= available
            if not fits_now or (self.running and not fits_reserve):
                self.cache.unlock(m.node)
                break  # keep policy order: later requests wait behind this one
            seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = list(m.pages), m.node, len(m.pages), m.length
            if m.length:
                self.cache.mark_reused(m.node)  # a hit: this prefix is worth more than a one-shot prompt's pages
            ok = self.bm.alloc_until(seq, m.length + n)
            assert ok, "checked above that the pages are free or evictable"
            if not seq.reported:
                self.queries_tokens += seq.num_prompt
                self.hits_tokens += m.length
                seq.cached_prompt_tokens = m.length
            self.waiting.remove(seq)
            self.running.append(seq)
            self._started.append(seq.req.request_id)
            dedup.admit(seq.tokens, salt)
            entries.append(ScheduledSeq(seq, n, prefill=True))
            budget -= n
            reserved += max(0, own_reserve)

    def _ordered_waiting(self) -> list[Candidate]:
        long_queue = len(self.waiting) > self.config.fcfs_fallback_queue
        policy = Policy.FCFS if long_queue else self.config.policy
        cands = []
        for seq in self.waiting:
            m = self.cache.match_prefix(seq.tokens[:-1], seq.req.cache_salt) if policy is not Policy.FCFS else None
            cands.append(Candidate(seq, m.length if m else 0, m.node if m else None, seq.req.priority,
                                   seq.req.arrival_time))
        return order(cands, policy, now=self.clock(), aging_s=self.config.aging_s)

    def _decode_estimate(self, seq: Seq) -> int:
        """Tokens `seq` is expected to still generate: new_token_ratio x what max_tokens allows."""
        return int(self.new_token_ratio * max(0, seq.req.params.max_tokens - seq.num_output))

    def _pages_to_go(self, seq: Seq) -> int:
        """Pages a running request is expected to still need (prefill left + estimated decode)."""
        to_go = len(seq.tokens) - seq.num_computed + self._decode_estimate(seq)
        return max(0, self.bm.pages_for(seq.num_computed + to_go) - len(seq.pages))

    def _draft(self, seq: Seq) -> list[int]:
        spec = self.config.speculative
        if spec is None or not speculative.can_draft(seq.req.params, seq.num_output):
            return []
        if seq.draft_cooldown > 0:  # recent drafts were all rejected: verifying them cost more than it gave
            seq.draft_cooldown -= 1
            return []
        # room for the drafts plus the target's bonus token within max_tokens and the context
        limit = min(seq.req.params.max_tokens - seq.num_output - 1, self.config.max_model_len - len(seq.tokens) - 1)
        return speculative.propose(seq.tokens, spec, limit)

    def _victim(self, exclude: list[Seq]) -> Seq | None:
        """The running request with the fewest generated tokens (newest on ties), not already in this step."""
        candidates = [q for q in self.running if q not in exclude]
        if len(self.running) <= 1 or not candidates:
            return None
        return min(candidates, key=lambda q: (q.num_output, -q.req.arrival_time))

    # ---- state changes -------------------------------------------------------------------------------------

    def _preempt(self, seq: Seq) -> None:
        """Back to the head of the queue; its computed pages stay in the cache for its return."""
        self.running.remove(seq)
        self.bm.release(seq, cache=True)
        if seq.scores_prompt:
            seq.prompt_logprobs = []  # scored again as the prompt is recomputed
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)

    def _fail(self, seq: Seq, message: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.bm.release(seq, cache=False)
        out = StepOutput(seq.req.request_id, 0, [], finish_reason=FinishReason.ERROR, error=CapacityError(message))
        stamp_first(seq, out)
        self._outputs.append(out)


def _chunk(e: ScheduledSeq) -> SeqChunk:
    """The runner's view of one entry (a prefill chunk also learns how many of its rows score the prompt)."""
    seq = e.seq
    start = seq.num_computed
    if e.prefill:
        end = start + e.num_tokens
        last = end == len(seq.tokens)
        # scoring the prompt: every prompt position's logits, each scoring the prompt token after it
        e.prompt_rows = max(0, min(e.num_tokens, seq.num_prompt - 1 - start)) if seq.scores_prompt else 0
        return SeqChunk(seq.tokens[start:end], start, seq.pages,
                        tuple(range(e.prompt_rows)) + ((e.num_tokens - 1,) if last else ()))
    if e.draft:
        tokens = [seq.tokens[-1], *e.draft]
        return SeqChunk(tokens, start, seq.pages, tuple(range(len(tokens))))
    return SeqChunk([seq.tokens[-1]], start, seq.pages)
