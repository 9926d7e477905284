"""The paged scheduler without a model: a fake runner whose logits make the next token
prompt[-1]+1, +2, ..., so every output is known in advance, even across preemptions."""

from __future__ import annotations

import random

import pytest
import torch

from duet.contract import FinishReason
from engine_core.engine_core import EngineCore
from engine_core.errors import CapacityError
from engine_core.kv_pool import PageAllocator
from engine_core.request import Request
from engine_core.sampler import Sampler
from engine_core.sampling_params import SamplingParams
from engine_paged.block_manager import BlockManager
from engine_paged.prefix_cache import PrefixCache
from engine_paged.scheduler import PagedScheduler, PagedSchedulerConfig

VOCAB = 512
EOS = 511


class CountingRunner:
    """Logits peak at (token + 1) % EOS for the last token of each chunk that asks for logits."""

    def __init__(self) -> None:
        self.steps: list[list] = []

    def forward(self, chunks):
        self.steps.append(chunks)
        rows = []
        for c in chunks:
            for pos in c.logits_positions:
                row = torch.full((VOCAB,), -10.0)
                row[(c.token_ids[pos] + 1) % EOS] = 10.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def make(num_pages=64, page=4, max_seqs=16, budget=64, priority=False, watermark=0.0, cache=False, prefill_cap=0):
    """`prefill_cap` 0: no cap on prefill while decoding (the budget alone, as most tests here assume)."""
    bm = BlockManager(PageAllocator(num_pages), page, watermark=watermark,
                      prefix_cache=PrefixCache("model", page) if cache else None)
    config = PagedSchedulerConfig(max_model_len=4096, vocab_size=VOCAB, eos_token_ids=(EOS,), max_num_seqs=max_seqs,
                                  max_num_batched_tokens=budget, max_prefill_tokens_while_decoding=prefill_cap,
                                  priority=priority)
    return PagedScheduler(config, bm, Sampler(VOCAB, (EOS,), seed=0), copy_pages=lambda pairs: None)


def req(rid, prompt, max_tokens, arrival, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, list(prompt), params, arrival_time=arrival)


def run(sched, runner, max_steps=10_000):
    """Drive EngineCore.step; collect tokens per (request, index); check pages each step."""
    tokens, finish, errors, order = {}, {}, {}, []
    core = EngineCore(sched, runner)
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for o in core.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.token_ids)
            if o.finish_reason is not None:
                finish[(o.request_id, o.index)] = o.finish_reason
                errors[o.request_id] = o.error
                order.append(o.request_id)
        sched.bm.check_integrity()
    assert not sched.has_unfinished(), "did not finish"
    assert sched.bm.num_free_pages == sched.bm.num_total_pages
    return tokens, finish, errors, order


def expected(prompt, n):
    return [(prompt[-1] + k) % EOS for k in range(1, n + 1)]


@pytest.mark.parametrize("cache", [False, True])
def test_preemption_storm_gives_every_request_its_exact_tokens(cache):
    rng = random.Random(0)
    sched = make(num_pages=40, page=4, max_seqs=12, budget=48, cache=cache)
    reqs = []
    for i in range(24):
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(1, 40))]
        reqs.append((f"r{i}", prompt, rng.randint(1, 40)))
        sched.add(req(f"r{i}", prompt, reqs[-1][2], arrival=i))
    tokens, finish, _, _ = run(sched, CountingRunner())
    assert sched.num_preemptions > 0
    for rid, prompt, max_tokens in reqs:
        assert tokens[(rid, 0)] == expected(prompt, max_tokens), rid
        assert finish[(rid, 0)] is FinishReason.LENGTH


def test_a_request_that_cannot_fit_alone_fails_clearly_and_others_finish():
    sched = make(num_pages=8, page=4, budget=64)  # 32 token slots in all
    sched.add(req("huge", [1] * 10, 100, arrival=0))
    sched.add(req("small", [5, 6], 4, arrival=1))
    tokens, finish, errors, _ = run(sched, CountingRunner())
    assert finish[("huge", 0)] is FinishReason.ERROR
    assert isinstance(errors["huge"], CapacityError) and "KV pages" in str(errors["huge"])
    assert tokens[("small", 0)] == expected([5, 6], 4)


def test_long_prompt_is_chunked_and_does_not_stall_decoding():
    sched = make(num_pages=256, page=4, budget=16)
    runner = CountingRunner()
    sched.add(req("short", [3], 30, arrival=0))
    for _ in range(3):  # short is decoding now
        sched.process(b := sched.schedule(), runner.forward(b.chunks))
    sched.add(req("long", list(range(1, 201)), 2, arrival=1))
    for _ in range(12):
        batch = sched.schedule()
        assert sum(len(c.token_ids) for c in batch.chunks) <= 16
        assert any(e.group.request_id == "short" for e in batch.entries), "decode stalled by a prefill"
        sched.process(batch, runner.forward(batch.chunks))


def test_fcfs_and_priority_order_of_admission():
    for priority, first in ((False, "a"), (True, "b")):
        sched = make(max_seqs=1, priority=priority)
        sched.add(Request("a", [1], SamplingParams(max_tokens=2, temperature=0), arrival_time=0, priority=5))
        sched.add(Request("b", [1], SamplingParams(max_tokens=2, temperature=0), arrival_time=1, priority=1))
        _, _, _, order = run(sched, CountingRunner())
        assert order[0] == first


def test_n_outputs_share_the_prompt_pages():
    sched = make(num_pages=128, page=4)
    prompt = list(range(1, 42))  # 41 tokens: 10 full pages + a partial one
    sched.add(req("n4", prompt, 3, arrival=0, n=4))
    runner = CountingRunner()
    used = []
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.process(batch, runner.forward(batch.chunks))
        used.append(sched.bm.num_used_pages)
        sched.bm.check_integrity()
    # 11 prompt pages shared; each output copies only the partial page (+ growth)
    assert max(used) <= 11 + 4 * 2 < 4 * 11


def test_beam_search_returns_ranked_whole_beams():
    sched = make(num_pages=64)
    sched.add(req("beam", [7, 8], 5, arrival=0, beam_width=3, n=2))
    tokens, _, _, _ = run(sched, CountingRunner())
    # the counting model's best path is deterministic; beam 0 is it
    assert tokens[("beam", 0)] == expected([7, 8], 5)
    assert len(tokens[("beam", 1)]) == 5 and tokens[("beam", 1)] != tokens[("beam", 0)]


@pytest.mark.parametrize("cache", [False, True])
def test_preemption_storm_with_forked_outputs_and_beams(cache):
    rng = random.Random(3)
    sched = make(num_pages=30, page=4, max_seqs=16, budget=40, cache=cache)
    heads = [[rng.randrange(1, 400) for _ in range(9)] for _ in range(3)]  # shared heads: the cache hits
    reqs = []
    for i in range(16):
        prompt = rng.choice(heads)[:rng.randint(0, 9)] + [rng.randrange(1, 400) for _ in range(rng.randint(1, 21))]
        kind = ("n", "beam", "one")[i % 3]
        kw = {"n": 3} if kind == "n" else {"beam_width": 2} if kind == "beam" else {}
        reqs.append((f"r{i}", prompt, rng.randint(2, 20), kind))
        sched.add(req(f"r{i}", prompt, reqs[-1][2], arrival=i, **kw))
    tokens, _, errors, _ = run(sched, CountingRunner())
    assert sched.num_preemptions > 0
    assert (sched.prompt_tokens_hit > 0) == cache
    for rid, prompt, max_tokens, kind in reqs:
        assert errors[rid] is None
        for index in range(3 if kind == "n" else 1):
            assert tokens[(rid, index)] == expected(prompt, max_tokens), (rid, index)



class TwoChoiceRunner:
    """Logits: `first` at 10 and `second` at 9 (fixed), else (token + 1) % EOS at 10 and (token + 2) % EOS at 9:
    a penalty on the first choice flips it."""

    def __init__(self, first=None, second=None) -> None:
        self.first, self.second = first, second

    def forward(self, chunks):
        rows = []
        for c in chunks:
            for pos in c.logits_positions:
                t = c.token_ids[pos]
                row = torch.full((VOCAB,), -10.0)
                row[self.first if self.first is not None else (t + 1) % EOS] = 10.0
                row[self.second if self.second is not None else (t + 2) % EOS] = 9.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def test_penalties_see_the_prompt_and_the_output_so_far():
    """The sampler reads the prompt and the output in place each step (no copies): a repetition penalty
    sees a prompt token, a frequency penalty the tokens generated so far, min_tokens the output's length."""
    sched = make()
    # 10 -> 11 is in the prompt: 10 / 4 = 2.5 < 9, so 12; then 13 and 14, never seen
    sched.add(req("rep", [11, 10], 3, arrival=0, repetition_penalty=4.0))
    tokens, _, _, _ = run(sched, TwoChoiceRunner())
    assert tokens[("rep", 0)] == [12, 13, 14]
    # always 30 (10) or 31 (9): a frequency penalty of 2 per use alternates them as the counts grow
    sched = make()
    sched.add(req("freq", [5], 5, arrival=0, frequency_penalty=2.0))
    tokens, _, _, _ = run(sched, TwoChoiceRunner(30, 31))
    assert tokens[("freq", 0)] == [30, 31, 30, 31, 30]
    # EOS first every step: held back until min_tokens outputs exist
    sched = make()
    sched.add(req("min", [5], 8, arrival=0, min_tokens=3))
    tokens, finish, _, _ = run(sched, TwoChoiceRunner(EOS, 40))
    assert tokens[("min", 0)] == [40, 40, 40, EOS] and finish[("min", 0)] == FinishReason.STOP
