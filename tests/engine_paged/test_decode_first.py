"""Decode room first, then a capped share for prefills (engine_paged.scheduler, issue 46 item 4): a long prompt
arriving among decoding requests adds at most `max_prefill_tokens_while_decoding` tokens to each of their steps,
still finishes its prefill in a bounded number of steps, and the page accounting stays exact throughout. With
`--max-decode-step-stretch` the share is the prompt tokens whose measured cost fits the stretch (the durations are
told to the scheduler, as the serving loop does, so these tests read no clock)."""

from __future__ import annotations

import pytest

from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_paged.prefill_budget import PrefillBudget
from engine_paged.sequence import GroupStatus
from tests.engine_paged.test_scheduler import CountingRunner, expected, make, req, run

CAP = 8
BUDGET = 64


def step(sched, runner, tokens):
    """One step; its outputs go into `tokens` ((request, index) -> ids). Returns (request ids that decoded one
    token this step, prefill tokens this step), read before the step's tokens count as computed."""
    batch = sched.schedule()
    decodes = {e.group.request_id for e in batch.entries if e.seq.num_computed >= e.seq.num_prompt}
    prefill = sum(e.num_tokens for e in batch.entries if e.seq.num_computed < e.seq.num_prompt)
    for o in sched.process(batch, runner.forward(batch.chunks)):
        tokens.setdefault((o.request_id, o.index), []).extend(o.token_ids)
    sched.bm.check_integrity()
    return decodes, prefill


def finish(sched, runner, tokens):
    """Run to the end; every request's tokens, those streamed before included."""
    rest, _, _, _ = run(sched, runner)
    for key, ids in rest.items():
        tokens.setdefault(key, []).extend(ids)
    return tokens


def test_every_decode_gets_its_token_and_prefill_takes_at_most_the_cap():
    sched, runner = make(num_pages=256, page=4, budget=BUDGET, prefill_cap=CAP), CountingRunner()
    shorts = [f"s{i}" for i in range(5)]
    for i, rid in enumerate(shorts):
        sched.add(req(rid, [10 + i, 20 + i], 80, arrival=i))
    tokens = {}
    step(sched, runner, tokens)  # the five prompts in one step: nobody decodes yet, so the whole budget is open
    long_prompt = list(range(1, 201))
    sched.add(req("doc", long_prompt, 3, arrival=10))
    steps_to_prefill = 0
    while sched.groups["doc"].seqs[0].num_computed < len(long_prompt):
        decodes, prefill = step(sched, runner, tokens)
        assert decodes == set(shorts), "a decoding request lost its token to the prefill"
        assert prefill == CAP, f"{prefill} prefill tokens in a step with 5 decodes (cap {CAP})"
        steps_to_prefill += 1
    # the prefill was never starved: the cap every step, so exactly ceil(200 / 8) steps
    assert steps_to_prefill == -(-len(long_prompt) // CAP)
    finish(sched, runner, tokens)
    assert tokens[("doc", 0)] == expected(long_prompt, 3)
    for i, rid in enumerate(shorts):
        assert tokens[(rid, 0)] == expected([10 + i, 20 + i], 80), rid


def test_without_decodes_a_prefill_takes_the_whole_budget():
    sched, runner = make(num_pages=256, page=4, budget=BUDGET, prefill_cap=CAP), CountingRunner()
    sched.add(req("doc", list(range(1, 201)), 2, arrival=0))
    _, prefill = step(sched, runner, {})
    assert prefill == BUDGET


def test_cap_zero_leaves_the_budget_to_prefill_beside_decodes():
    sched, runner = make(num_pages=256, page=4, budget=BUDGET, prefill_cap=0), CountingRunner()
    sched.add(req("chat", [5, 6], 40, arrival=0))
    step(sched, runner, {})
    sched.add(req("doc", list(range(1, 201)), 2, arrival=1))
    decodes, prefill = step(sched, runner, {})
    assert decodes == {"chat"} and prefill == BUDGET - 1


def test_a_stream_of_new_requests_does_not_starve_the_running_prefill():
    """New short requests keep arriving while a long prompt prefills beside decodes: the oldest prefill keeps
    its share every step, and every request gets its exact tokens."""
    sched, runner = make(num_pages=512, page=4, budget=BUDGET, prefill_cap=CAP), CountingRunner()
    tokens = {}
    sched.add(req("chat", [7, 8], 60, arrival=0))
    step(sched, runner, tokens)
    long_prompt = list(range(1, 121))
    sched.add(req("doc", long_prompt, 4, arrival=1))
    prompts = {}
    for k in range(15):
        rid = f"late{k}"
        prompts[rid] = [30 + k, 40 + k, 50 + k]
        sched.add(req(rid, prompts[rid], 5, arrival=2 + k))
        step(sched, runner, tokens)
    assert sched.groups["doc"].seqs[0].num_computed == len(long_prompt), "the long prefill fell behind its cap"
    finish(sched, runner, tokens)
    assert tokens[("doc", 0)] == expected(long_prompt, 4)
    for rid, prompt in prompts.items():
        assert tokens[(rid, 0)] == expected(prompt, 5), rid


def test_a_prefill_that_preempts_a_decoding_request_withdraws_its_entry():
    """The decode pass has scheduled B; the older A's prefill chunk then needs B's pages and preempts it. B's
    entry must leave the step: its pages are free again (and may be A's by now)."""
    sched, runner = make(num_pages=10, page=4, budget=8, priority=True), CountingRunner()
    tokens = {}
    sched.add(Request("B", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0), arrival_time=0, priority=1))
    step(sched, runner, tokens)
    step(sched, runner, tokens)
    # A goes ahead of B in the running order (priority 0), so A's prefill may preempt B, the newest
    sched.add(Request("A", list(range(100, 130)), SamplingParams(max_tokens=2, temperature=0.0), arrival_time=1))
    saw_withdrawal = False
    for _ in range(40):
        if not sched.has_unfinished():
            break
        before = sched.num_preemptions
        batch = sched.schedule()
        for e, chunk in zip(batch.entries, batch.chunks):
            assert e.group.status is GroupStatus.RUNNING, f"{e.group.request_id} is scheduled but not running"
            assert chunk.page_table == sched.bm.block_table(e.seq.seq_id)
        saw_withdrawal |= sched.num_preemptions > before
        for o in sched.process(batch, runner.forward(batch.chunks)):
            tokens.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        sched.bm.check_integrity()
    assert saw_withdrawal, "the scenario no longer makes A's prefill preempt B"
    finish(sched, runner, tokens)
    assert tokens[("A", 0)] == expected(list(range(100, 130)), 2)
    assert tokens[("B", 0)] == expected([1, 2, 3], 30)


# -- the time budget (--max-decode-step-stretch, engine_paged.prefill_budget) -----------------------------------
def make_stretched(stretch, cap=BUDGET, floor=None):
    sched = make(num_pages=256, page=4, budget=BUDGET, prefill_cap=cap)
    sched.prefill_budget = PrefillBudget(cap, stretch, **({} if floor is None else {"floor": floor}))
    return sched


def teach(sched, decode_step_s=0.1, prefill_s_per_token=0.002, prefill_tokens=50):
    """Durations as the serving loop reports them: decode-only steps, and steps that also prefilled."""
    for _ in range(4):
        sched.observe_step(decode_step_s, 0, 5)
        sched.observe_step(decode_step_s + prefill_s_per_token * prefill_tokens, prefill_tokens, 5)


def test_the_time_budget_is_the_prefill_whose_measured_cost_fits_the_stretch():
    budget = PrefillBudget(cap=256, stretch=2.0, floor=4)
    assert budget.tokens_while_decoding() == 256  # nothing measured yet: the cap
    budget.observe(0.1, 0, 5)
    assert budget.tokens_while_decoding() == 256  # a decode step but no prefill cost yet
    budget.observe(0.1 + 0.002 * 100, 100, 5)  # 100 prompt tokens cost 0.2 s beyond a decode step
    assert budget.decode_step_s == 0.1 and abs(budget.prefill_s_per_token - 0.002) < 1e-12
    assert budget.tokens_while_decoding() == 50  # (2 - 1) x 0.1 s / 2 ms
    assert PrefillBudget(256, 3.0, floor=4, window=4).tokens_while_decoding() == 256
    slow = PrefillBudget(cap=256, stretch=1.5, floor=32)
    slow.observe(0.05, 0, 1)
    slow.observe(0.05 + 0.01 * 64, 64, 1)  # 10 ms a prompt token: 2.5 tokens fit, the floor gives 32
    assert slow.tokens_while_decoding() == 32
    fast = PrefillBudget(cap=256, stretch=4.0)
    fast.observe(0.1, 0, 8)
    fast.observe(0.1 + 1e-5 * 512, 512, 8)  # thousands would fit: the cap is the ceiling
    assert fast.tokens_while_decoding() == 256
    assert PrefillBudget(cap=64).tokens_while_decoding() == 64  # stretch off: the cap alone, measured or not
    for bad in ({"cap": -1}, {"cap": 8, "stretch": 1.0}, {"cap": 8, "stretch": 2.0, "floor": 0}):
        with pytest.raises(ValueError):
            PrefillBudget(**bad)


def test_a_stretched_schedule_gives_a_prefill_the_tokens_its_time_budget_allows():
    """Five requests decode; a long prompt arrives. With decode steps of 0.1 s and 2 ms a prompt token, stretch 1.5
    lets each decoding step add 25 prompt tokens, and every decode still gets its token each step."""
    sched, runner = make_stretched(1.5, floor=4), CountingRunner()
    teach(sched)
    shorts = [f"s{i}" for i in range(5)]
    for i, rid in enumerate(shorts):
        sched.add(req(rid, [10 + i, 20 + i], 80, arrival=i))
    tokens = {}
    step(sched, runner, tokens)
    long_prompt = list(range(1, 201))
    sched.add(req("doc", long_prompt, 3, arrival=10))
    chunks = []
    while sched.groups["doc"].seqs[0].num_computed < len(long_prompt):
        decodes, prefill = step(sched, runner, tokens)
        assert decodes == set(shorts), "a decoding request lost its token to the prefill"
        chunks.append(prefill)
    assert chunks == [25] * 8, chunks
    finish(sched, runner, tokens)
    assert tokens[("doc", 0)] == expected(long_prompt, 3)
    for i, rid in enumerate(shorts):
        assert tokens[(rid, 0)] == expected([10 + i, 20 + i], 80), rid


def test_a_stretched_schedule_follows_the_costs_it_is_told_and_leaves_idle_steps_whole():
    """Costlier prompt tokens, fewer of them beside decodes; nothing decoding, the whole step budget."""
    sched, runner = make_stretched(2.0, floor=4), CountingRunner()
    sched.add(req("doc", list(range(1, 201)), 2, arrival=0))
    _, prefill = step(sched, runner, {})
    assert prefill == BUDGET  # nobody decodes: the whole budget, whatever the costs
    sched = make_stretched(2.0, floor=4)
    teach(sched, decode_step_s=0.1, prefill_s_per_token=0.01)  # 10 tokens fit in one more decode step's time
    sched.add(req("chat", [5, 6], 40, arrival=0))
    step(sched, runner, {})
    sched.add(req("doc", list(range(1, 201)), 2, arrival=1))
    decodes, prefill = step(sched, runner, {})
    assert decodes == {"chat"} and prefill == 10
    sched.observe_step(0.1, 0, 1)  # the worker speeds up: cheaper prompt tokens measured, more fit
    for _ in range(32):
        sched.observe_step(0.1 + 0.004 * 10, 10, 1)
    decodes, prefill = step(sched, runner, {})
    assert decodes == {"chat"} and prefill == 25


# -- the time budget knows that a prompt token deeper in its prompt costs more (its attention reads more keys) ---------
A, B = 0.001, 2e-6  # seconds a prompt token, seconds a key it attends to (beyond a decode step)


def chunk_cost(n, position):
    """What n prompt tokens from `position` cost when every token costs A and every key it reads B."""
    return sum(A + B * (position + t + 1) for t in range(n))


def test_the_time_budget_fits_a_token_cost_and_a_key_cost_and_gives_deeper_chunks_fewer_tokens():
    budget = PrefillBudget(cap=512, stretch=1.5, floor=1)
    for position, n in [(0, 64), (1000, 64), (2000, 32), (500, 128), (3000, 16)] * 2:
        budget.observe(0.1, 0, 4)
        keys = n * (position + n / 2)
        budget.observe(0.1 + A * n + B * keys, n, 4, keys)
    a, b = budget.costs()
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)
    slack = 0.5 * 0.1
    for position in (0, 500, 2000, 8000):
        n = budget.tokens_while_decoding(position)
        # the most tokens whose cost fits the slack (to the key's half-token rounding of n x (position + n / 2))
        assert chunk_cost(n, position) <= slack * 1.01 < chunk_cost(n + 2, position), (position, n)
    assert budget.tokens_while_decoding(0) > 3 * budget.tokens_while_decoding(2000)


def test_without_keys_or_with_chunks_all_alike_the_budget_is_the_plain_ratio():
    keyless = PrefillBudget(cap=512, stretch=2.0, floor=1)
    keyless.observe(0.1, 0, 4)
    keyless.observe(0.1 + 0.2, 100, 4)  # a scheduler that says no keys: the token cost alone
    assert keyless.costs() == (pytest.approx(0.002), 0.0)
    alike = PrefillBudget(cap=512, stretch=2.0, floor=1)
    alike.observe(0.1, 0, 4)
    for _ in range(3):
        alike.observe(0.1 + 0.2, 100, 4, 100 * 50)  # the same chunk each time: the two costs cannot be told apart
    assert alike.costs() == (pytest.approx(0.002), 0.0)
    assert alike.tokens_while_decoding(0) == alike.tokens_while_decoding(5000) == 50


def test_a_stretched_schedule_shrinks_a_long_prompts_chunks_as_they_go_deeper():
    """One request decodes while a 600-token prompt prefills: each chunk is what its own position's cost allows,
    so the decoding request's steps stay within the stretch all the way, not only at the prompt's start."""
    sched, runner = make_stretched(1.5, cap=512, floor=1), CountingRunner()
    for position, n in [(0, 64), (1000, 64), (2000, 32), (500, 128)]:
        keys = n * (position + n / 2)
        sched.prefill_budget.observe(0.1, 0, 1)
        sched.prefill_budget.observe(0.1 + A * n + B * keys, n, 1, keys)
    sched.add(req("chat", [5, 6], 400, arrival=0))
    step(sched, runner, {})
    sched.add(req("doc", list(range(1, 601)), 2, arrival=1))
    chunks, position = [], 0
    while sched.groups["doc"].seqs[0].num_computed < 600:
        decodes, prefill = step(sched, runner, {})
        assert decodes == {"chat"}
        assert chunk_cost(prefill, position) <= 0.05 * 1.01 or position + prefill == 600, (position, prefill)
        chunks.append(prefill)
        position += prefill
    assert sched.num_preemptions == 0
    assert chunks[0] == 47 and chunks[-2] <= 23, chunks  # 47 tokens fit at position 0; the last is the remainder
