"""One scheduling step of engine_prefix: decode (with retraction), continue chunked prefills, admit.

Split from scheduler.py so each reads on its own. ``schedule_step`` sees the scheduler only through
``AdmissionHost``, the small interface this module owns and ``PrefixScheduler`` satisfies, so nothing here
imports the scheduler back (see the scheduler's docstring for the page-ownership contract it keeps).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from engine_core.forward_batch import SeqChunk
from engine_prefix import speculative
from engine_prefix.policy import Candidate, InBatchDedup
from engine_prefix.radix_cache import RadixCache
from engine_prefix.sequence import Entry, PrefixBatch, Seq


class AdmissionHost(Protocol):
    """What one scheduling step reads and changes on the scheduler."""

    config: Any  # engine_prefix.scheduler.PrefixSchedulerConfig
    allocator: Any  # engine_core.kv_pool.PageAllocator
    cache: RadixCache
    waiting: deque[Seq]
    running: list[Seq]
    started: list[str]  # request ids admitted this step (the step loop streams a progress message)
    new_token_ratio: float
    queries_tokens: int
    hits_tokens: int

    def alloc_until(self, seq: Seq, num_tokens: int) -> bool:
        """Grow the request's pages to hold `num_tokens`, evicting cached pages if needed."""

    def retract(self, seq: Seq) -> None:
        """Back to the queue's head; its computed pages stay cached."""

    def fail(self, seq: Seq, message: str) -> None:
        """End the request with CapacityError."""

    def ordered_waiting(self) -> list[Candidate]: ...

    def new_dedup(self) -> InBatchDedup: ...


def schedule_step(s: AdmissionHost) -> PrefixBatch | None:
    cfg = s.config
    entries: list[Entry] = []
    budget = cfg.max_num_batched_tokens
    retracted = False

    # 1. decode: most generated first, so retraction victims (fewest generated) come last
    decoding = sorted((q for q in s.running if q.num_computed == len(q.tokens) - 1),
                      key=lambda q: len(q.tokens) - q.num_prompt, reverse=True)
    for seq in decoding:
        if seq not in s.running or budget <= 0:
            continue
        draft = _draft(s, seq)
        if draft and not s.alloc_until(seq, len(seq.tokens) + len(draft)):
            draft = []
        while not s.alloc_until(seq, len(seq.tokens)):
            victim = _victim(s, exclude=[e.seq for e in entries])
            if victim is None:  # alone and still no room: it can never finish here
                s.fail(seq, f"KV cache exhausted: request {seq.req.request_id} needs more than the "
                            f"{s.allocator.num_total} pages this worker holds")
                break
            s.retract(victim)
            retracted = True
            if victim is seq:
                break
        if seq not in s.running:
            continue
        entries.append(Entry(seq, 1 + len(draft), draft))
        budget -= 1 + len(draft)
    if not retracted:
        s.new_token_ratio = max(cfg.min_new_token_ratio, s.new_token_ratio - cfg.new_token_ratio_decay)

    # 2. chunked prefills already running
    for seq in [q for q in s.running if q.num_computed < len(q.tokens) - 1]:
        if budget <= 0:
            break
        n = min(len(seq.tokens) - seq.num_computed, budget)
        if not s.alloc_until(seq, seq.num_computed + n):
            if len(s.running) > 1:
                s.retract(seq)
                retracted = True
            else:
                s.fail(seq, f"KV cache exhausted: the prompt of {seq.req.request_id} does not fit")
            continue
        entries.append(Entry(seq, n, prefill=True))
        budget -= n

    # 3. admit waiting requests (not in a step that had to retract: memory is short)
    if not retracted and s.waiting and budget > 0 and len(s.running) < cfg.max_num_seqs:
        budget = _admit(s, entries, budget)

    if not entries:
        return None
    chunks = [_chunk(e) for e in entries]
    return PrefixBatch(chunks, entries)


def _draft(s: AdmissionHost, seq: Seq) -> list[int]:
    spec = s.config.speculative
    if spec is None or not speculative.can_draft(seq.req.params, len(seq.tokens) - seq.num_prompt):
        return []
    if seq.draft_cooldown > 0:  # recent drafts were all rejected: verifying them cost more than it gave
        seq.draft_cooldown -= 1
        return []
    out_len = len(seq.tokens) - seq.num_prompt
    # room for the drafts plus the target's bonus token within max_tokens and the context
    limit = min(seq.req.params.max_tokens - out_len - 1, s.config.max_model_len - len(seq.tokens) - 1)
    return speculative.propose(seq.tokens, spec, limit)


def _victim(s: AdmissionHost, exclude: list[Seq]) -> Seq | None:
    """The running request with the fewest generated tokens (newest on ties), not already in this step."""
    pool = [q for q in s.running if q not in exclude]
    if len(s.running) <= 1 or not pool:
        return None
    return min(pool, key=lambda q: (len(q.tokens) - q.num_prompt, -q.req.arrival_time))


def _reserved_pages(s: AdmissionHost) -> int:
    """Pages the running requests are expected to still need (prefill left + estimated decode)."""
    total = 0
    for q in s.running:
        to_go = len(q.tokens) - q.num_computed
        to_go += int(s.new_token_ratio * max(0, q.req.params.max_tokens - (len(q.tokens) - q.num_prompt)))
        total += max(0, -(-(q.num_computed + to_go) // s.config.page_size) - len(q.pages))
    return total


def _admit(s: AdmissionHost, entries: list, budget: int) -> int:
    cfg = s.config
    dedup = s.new_dedup()
    for e in entries:  # chunked prefills still computing their prompt count as in this batch too
        if e.prefill:
            dedup.admit(e.seq.tokens, e.seq.req.cache_salt)
    reserved = _reserved_pages(s)
    for cand in s.ordered_waiting():
        if budget <= 0 or len(s.running) >= cfg.max_num_seqs:
            break
        seq: Seq = cand.item
        salt = seq.req.cache_salt
        # fresh: an earlier admission may have evicted; none for a prompt to score (every position's logits)
        m = s.cache.match_prefix([] if seq.scores_prompt else seq.tokens[:-1], salt)
        if dedup.should_wait(seq.tokens, salt, m.length):
            continue
        s.cache.lock(m.node)
        n = min(len(seq.tokens) - m.length, budget)
        pages_now = -(-(m.length + n) // cfg.page_size) - len(m.pages)
        decode_tokens = int(s.new_token_ratio * max(0, seq.req.params.max_tokens - (len(seq.tokens) - seq.num_prompt)))
        own_reserve = -(-(len(seq.tokens) + decode_tokens) // cfg.page_size) - len(m.pages) - pages_now
        available = s.allocator.num_free + s.cache.evictable_pages
        fits_now = pages_now <= available
        fits_reserve = pages_now + max(0, own_reserve) + reserved <= available
        if not fits_now or (s.running and not fits_reserve):
            s.cache.unlock(m.node)
            break  # keep policy order: later requests wait behind this one
        seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = list(m.pages), m.node, len(m.pages), m.length
        if m.length:
            s.cache.mark_reused(m.node)  # a hit: this prefix is worth more than a one-shot prompt's pages
        ok = s.alloc_until(seq, m.length + n)
        assert ok, "checked above that the pages are free or evictable"
        if not seq.reported:
            s.queries_tokens += seq.num_prompt
            s.hits_tokens += m.length
            seq.cached_prompt_tokens = m.length
        s.waiting.remove(seq)
        s.running.append(seq)
        s.started.append(seq.req.request_id)
        dedup.admit(seq.tokens, salt)
        entries.append(Entry(seq, n, prefill=True))
        budget -= n
        reserved += max(0, own_reserve)
    return budget


def _chunk(e: Entry) -> SeqChunk:
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
