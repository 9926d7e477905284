"""Continuous batching over paged KV: who runs this step, with how many tokens.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
  1. decode tokens of running sequences first (one each), oldest request first: every decoding
     sequence gets its token before any prefill is considered;
  2. then prefill chunks of running requests still in their prompt, oldest first, so a long prompt
     is cut in chunks and never stalls the decoding of others;
  3. then new requests from the waiting queue, FCFS (with `priority`: lower value first, FCFS
     among equals), head of line only, while budget, sequence cap and free pages (above the
     watermark) allow. Nothing is admitted in a step that had to preempt. With the prefix cache
     (engine_paged.prefix_cache) a sequence starts from its longest cached prefix; the cached pages
     it takes from the LRU count against the free room, and the hit is reported as cached_tokens.
In a step that decodes, 2 and 3 together add at most `max_prefill_tokens_while_decoding` tokens (as
vLLM's chunked prefill bounds partial prefills), so a document's prefill makes each decode step only
that much longer instead of a whole budget's worth; the oldest prefill still gets the cap every step,
so it finishes in a bounded number of steps. A step with nothing to decode prefills the whole budget. With
`max_decode_step_stretch` the share is a time budget instead, from the worker's measured step costs
(engine_paged.prefill_budget: the serving loop reports each step's duration through `observe_step`), the cap
its ceiling.
When a running sequence needs a page and none is free, the NEWEST running request is preempted:
its pages are freed, its entries of this step are withdrawn, and it goes back to the waiting queue
at its original place, to be recomputed from its prompt and the tokens it already produced (nothing
already streamed is sent again). The oldest request is therefore never preempted by a newer one: no
starvation. If a request cannot get a page even when it runs alone, it ends with CapacityError and the
others go on.

Sampling, n > 1 forks and beam search live in `engine_paged.postprocess.OutputProcessor`, which this
scheduler owns (it never imports the scheduler back).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from duet.contract import FinishReason
from duet.engine_config import ENGINE_DEFAULTS, PREFILL_TOKENS_WHILE_DECODING
from engine_core.errors import CapacityError, InvalidRequestError
from engine_core.forward_batch import SeqChunk
from engine_core.request import KvEvent, LoadStats, Request, StepOutput
from engine_core.sampler import Sampler
from engine_core.scheduler_protocol import SchedulerOutput
from engine_paged.block_manager import BlockManager
from engine_paged.postprocess import OutputProcessor
from engine_paged.prefill_budget import PrefillBudget
from engine_paged.sequence import GroupStatus, ScheduledSeq, Sequence, SequenceGroup


@dataclass(frozen=True)
class PagedSchedulerConfig:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    max_prefill_tokens_while_decoding: int = PREFILL_TOKENS_WHILE_DECODING["cpu"]  # 0: no cap
    max_decode_step_stretch: float = 0.0  # 0: the cap alone; S > 1: prefill within (S - 1) x a decode step's time
    priority: bool = False  # honour Request.priority (lower first)


class PagedScheduler:
    """Implements engine_core.scheduler_protocol.Scheduler. `copy_pages(pairs)` copies the KV of
    page src into page dst for every layer (copy-on-write); it runs before the step's forward."""

    def __init__(self, config: PagedSchedulerConfig, block_manager: BlockManager, sampler: Sampler,
                 copy_pages: Callable[[list[tuple[int, int]]], None]) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.config = config
        self.bm = block_manager
        self.sampler = sampler
        self.copy_pages = copy_pages
        self.prefill_budget = PrefillBudget(config.max_prefill_tokens_while_decoding, config.max_decode_step_stretch)
        self.outputs = OutputProcessor(block_manager, sampler, config.eos_token_ids, config.max_model_len)
        self.waiting: list[SequenceGroup] = []  # sorted by group.order
        self.running: list[SequenceGroup] = []  # sorted by group.order: the last one is the newest
        self.groups: dict[str, SequenceGroup] = {}
        self.num_preemptions = 0
        self._last_prefill_keys = 0.0  # the attention work of the last step's prompt tokens (observe_step)
        self.prompt_tokens_queried = 0  # prefix cache: prompt tokens of admitted requests ...
        self.prompt_tokens_hit = 0  # ... and how many of them were cached
        self._outputs: list[StepOutput] = []
        self._started: list[str] = []
        self._counter = itertools.count()

    # -- the protocol: requests in and out ------------------------------------------------
    def validate(self, request: Request) -> None:
        p, n_prompt = request.params, len(request.prompt_token_ids)
        if n_prompt >= self.config.max_model_len:
            raise InvalidRequestError(f"the prompt has {n_prompt} tokens but the model's context is "
                                      f"{self.config.max_model_len}, which leaves no room to generate")
        if p.json_schema is not None or p.json_object or p.regex is not None:
            raise InvalidRequestError("structured output is not supported by the paged engine (engine_prefix has it)")
        if p.speculative:
            raise InvalidRequestError("speculative decoding is not supported by the paged engine (engine_prefix has it)")
        if p.beam_width > 1 and p.n > p.beam_width:
            raise InvalidRequestError(f"n={p.n} must not exceed beam_width={p.beam_width} with beam search")
        width = p.beam_width if p.beam_width > 1 else p.n
        if width > self.config.max_num_seqs:
            raise InvalidRequestError(f"{width} parallel outputs exceed this worker's max_num_seqs "
                                      f"({self.config.max_num_seqs})")
        if self.bm.pages_for(n_prompt + 1) > self.bm.num_total_pages:
            raise CapacityError(f"the prompt needs {self.bm.pages_for(n_prompt + 1)} KV pages, more than the "
                                f"{self.bm.num_total_pages} this worker has")

    def add(self, request: Request) -> None:
        seed = request.params.seed
        seq = Sequence(0, list(request.prompt_token_ids), len(request.prompt_token_ids),
                       self.sampler.make_generator(seed))
        key = (request.priority if self.config.priority else 0, request.arrival_time, next(self._counter))
        group = SequenceGroup(request, [seq], key)
        self.groups[request.request_id] = group
        bisect.insort(self.waiting, group, key=lambda g: g.order)

    def abort(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return False
        self._finish_group(group)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def take_outputs(self) -> list[StepOutput]:
        out, self._outputs = self._outputs, []
        return out

    def take_started(self) -> list[str]:
        out, self._started = self._started, []
        return out

    def take_kv_events(self) -> list[KvEvent]:
        return self.bm.take_kv_events()

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """How long the step last scheduled took (the serving loop's clock, or a simulator's): the time budget of
        prefill beside decodes is measured from these, with the attention work its prompt tokens did."""
        self.prefill_budget.observe(seconds, prefill_tokens, decode_tokens, self._last_prefill_keys)

    def load(self) -> LoadStats:
        return LoadStats(len(self.running), len(self.waiting), self.bm.num_used_pages, self.bm.num_total_pages,
                         prefix_cache_queries_tokens=self.prompt_tokens_queried,
                         prefix_cache_hits_tokens=self.prompt_tokens_hit, num_preemptions=self.num_preemptions,
                         reused_pages_evicted=self.bm.cache.reused_pages_evicted if self.bm.cache else 0)

    def process(self, batch: SchedulerOutput[ScheduledSeq], logits) -> list[StepOutput]:
        outputs = self.outputs.process(batch, logits)
        for group in [g for g in self.running if g.status is GroupStatus.FINISHED]:
            self._finish_group(group)
        return outputs

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput[ScheduledSeq] | None:
        batch = SchedulerOutput()
        budget, preempted = self._schedule_running(batch, self.config.max_num_batched_tokens, decode_pass=True)
        timed = bool(self.prefill_budget.stretch)  # only a time budget reads the position and the keys
        if batch.entries:  # the decodes have their tokens; prefills share at most the cap
            cap = self.prefill_budget.tokens_while_decoding(self._next_prefill_position() if timed else 0)
            budget = min(budget, cap) if cap else budget
        budget, preempted_for_prefill = self._schedule_running(batch, budget, decode_pass=False)
        if not (preempted or preempted_for_prefill):
            self._admit(batch, budget)
        if timed:  # what this step's prompt tokens attend to: each chunk's n tokens from start, n x (start + n / 2)
            self._last_prefill_keys = sum(len(c.token_ids) * (c.start_pos + len(c.token_ids) / 2)
                                          for c in batch.chunks if len(c.token_ids) > 1)
        return batch if batch.entries else None

    def _next_prefill_position(self) -> int:
        """Where the first prompt chunk a step would add starts: the oldest running prefill's computed tokens, or
        0 for an admission (its cached prefix is not known before it is matched)."""
        for group in self.running:
            for seq in group.live:
                if seq.num_uncomputed > 1:
                    return seq.num_computed
        return 0

    def _schedule_running(self, batch: SchedulerOutput, budget: int, decode_pass: bool) -> tuple[int, bool]:
        """One pass over the running groups, oldest first; (budget left, preempted?)."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            result = self._schedule_group(group, batch, budget, decode_pass)
            if result is None:  # could not get pages even after preempting everyone newer
                preempted = True
                if i == 0 and len(self.running) == 1:
                    self._fail(group, CapacityError(
                        f"request {group.request_id} needs more KV pages than this worker has "
                        f"({self.bm.num_total_pages} pages of {self.bm.page_size} tokens)"))
                else:
                    self._preempt(group)
                continue
            budget, did_preempt = result
            preempted |= did_preempt
            i += 1
        return budget, preempted

    def _schedule_group(self, group: SequenceGroup, batch: SchedulerOutput, budget: int, decode_pass: bool):
        """Slots for this pass's sequences of `group`; (budget left, preempted?) or None when the
        group itself must give way (its entries of this step are withdrawn)."""
        preempted = False
        for seq in group.live:
            if (seq.num_uncomputed == 1) != decode_pass or seq.num_uncomputed == 0 or budget <= 0:
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.bm.can_append(seq.seq_id, n):
                victim = self.running[-1]
                if victim is group:
                    self._withdraw(batch, group)
                    return None
                self._withdraw(batch, victim)  # a prefill can preempt a group whose decode is already in
                self._preempt(victim)
                preempted = True
            self._add_entry(batch, group, seq, n)
            budget -= n
        return budget, preempted

    def _admit(self, batch: SchedulerOutput, budget: int) -> int:
        num_seqs = sum(g.width for g in self.running)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            salt = group.request.cache_salt
            if num_seqs + group.width > self.config.max_num_seqs:
                break
            # pages: fresh ones for the uncached part, plus cached pages nobody holds (taking them uses free room)
            plan, fresh, hits = [], 0, []
            for seq in group.live:
                left = budget - sum(k for _, k in plan)
                if left <= 0:
                    break
                hit = [] if group.scores_prompt else self.bm.match_prefix(seq.token_ids, salt)
                cached = len(hit) * self.bm.page_size
                n = min(len(seq.token_ids) - cached, left)
                plan.append((seq, n))
                fresh += self.bm.pages_for(cached + n) - len(hit)
                hits += hit
            if not plan or not self.bm.can_admit_pages(fresh + self.bm.num_evictable_among(hits)):
                break
            self.waiting.pop(0)
            group.status = GroupStatus.RUNNING
            self._started.append(group.request_id)
            bisect.insort(self.running, group, key=lambda g: g.order)
            for seq, _ in plan:  # take every hit first, so this group's own appends cannot evict them
                seq.num_computed = self.bm.allocate_cached(seq.seq_id, seq.token_ids, salt,
                                                           use_cache=not group.scores_prompt)
            if group.cached_tokens is None:
                group.cached_tokens = plan[0][0].num_computed
                self.prompt_tokens_queried += len(group.request.prompt_token_ids)
                self.prompt_tokens_hit += group.cached_tokens
            for seq, _ in plan:
                n = min(seq.num_uncomputed, budget)
                self._add_entry(batch, group, seq, n)
                budget -= n
            num_seqs += group.width
        return budget

    @staticmethod
    def _withdraw(batch: SchedulerOutput, group: SequenceGroup) -> None:
        """Take `group`'s entries out of this step: it is giving way, its pages are about to be freed. Their
        tokens do not go back to the budget (a step that preempts admits nothing)."""
        keep = [i for i, e in enumerate(batch.entries) if e.group is not group]
        batch.entries[:] = [batch.entries[i] for i in keep]
        batch.chunks[:] = [batch.chunks[i] for i in keep]

    def _add_entry(self, batch: SchedulerOutput, group: SequenceGroup, seq: Sequence, n: int) -> None:
        copies = self.bm.append_slots(seq.seq_id, n)
        if copies:
            self.copy_pages(copies)
        start = seq.num_computed
        last = start + n == len(seq.token_ids)
        # scoring the prompt: every prompt position's logits, each scoring the prompt token after it
        prompt_rows = max(0, min(n, seq.num_prompt - 1 - start)) if group.scores_prompt else 0
        positions = tuple(range(prompt_rows)) + ((n - 1,) if last else ())
        batch.chunks.append(SeqChunk(seq.token_ids[start:start + n], start, self.bm.block_table(seq.seq_id),
                                     positions))
        batch.entries.append(ScheduledSeq(group, seq, n, last, prompt_rows))

    # -- state changes ----------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup) -> None:
        """Free the group's pages; it will recompute from its tokens when admitted again."""
        self.running.remove(group)
        for seq in group.seqs:
            self.bm.free(seq.seq_id)
            seq.num_computed = 0
        group.status = GroupStatus.WAITING
        group.beam_logits = {}
        if group.scores_prompt:
            group.prompt_logprobs = []  # the prompt is scored again as it is recomputed
        bisect.insort(self.waiting, group, key=lambda g: g.order)
        self.num_preemptions += 1

    def _fail(self, group: SequenceGroup, error: Exception) -> None:
        self._outputs.append(StepOutput(group.request_id, 0, [], finish_reason=FinishReason.ERROR, error=error))
        self._finish_group(group)

    def _finish_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.bm.free(seq.seq_id)
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        group.status = GroupStatus.FINISHED
        self.groups.pop(group.request_id, None)
