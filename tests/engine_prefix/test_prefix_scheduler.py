"""The cache-aware scheduler, stepped by hand over the real tiny model: admission order, in-batch
de-duplication, chunked prefill sharing its partial prefix, preemption under memory pressure, and the lone
request that cannot fit. check_integrity() after every step."""

from __future__ import annotations

import dataclasses
import random

import pytest

from duet.contract import FinishReason
from duet.engine_config import EngineConfig, PrefixConfig
from engine_core.kv_pool import PageAllocator
from engine_core.llm import LLM
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_prefix.policy import Candidate, Policy, order
from engine_prefix.radix_cache import RadixCache
from engine_prefix.worker import build_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Driver:
    def __init__(self, checkpoint, prefix: dict | None = None, **kw):
        parts = build_engine(PrefixConfig(EngineConfig(model=str(checkpoint), **kw), **(prefix or {})))
        self.s, self.runner = parts.scheduler, parts.runner
        self.tokens: dict[str, list[int]] = {}
        self.first: dict[str, object] = {}
        self.finish: dict[str, FinishReason] = {}
        self.errors: dict[str, object] = {}
        self.batches: list[list[str]] = []  # request ids prefilling in each step

    def add(self, rid, prompt, params=GREEDY, salt=""):
        req = Request(rid, list(prompt), params, cache_salt=salt)
        self.s.validate(req)
        self.s.add(req)
        self.tokens[rid] = []

    def step(self) -> bool:
        batch = self.s.schedule()
        outs = self.s.take_outputs()
        if batch is not None:
            self.batches.append([e.seq.req.request_id for e in batch.entries if e.prefill])
            outs += self.s.process(batch, self.runner.forward(batch.chunks))
        for o in outs:
            self.first.setdefault(o.request_id, o)
            self.tokens[o.request_id] += o.token_ids
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
                self.errors[o.request_id] = o.error
        self.s.check_integrity()
        return batch is not None

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError("the scheduler did not finish (deadlock?)")


def rand_tokens(rng, n):
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_longest_cached_prefix_is_admitted_first(tiny_checkpoint):
    rng = random.Random(1)
    d = Driver(tiny_checkpoint, kv_cache_tokens=4096, max_num_seqs=1)
    hot = rand_tokens(rng, 64)
    d.add("warm", hot + [5])
    d.run()
    d.add("cold", rand_tokens(rng, 70))  # arrived first, nothing cached
    d.add("hot", hot + [9, 9])  # 64 tokens cached
    d.step()
    assert d.batches[-1] == ["hot"]
    d.run()
    assert d.first["hot"].cached_tokens == 64 and d.first["cold"].cached_tokens == 0


def test_a_very_long_queue_falls_back_to_fcfs(tiny_checkpoint):
    rng = random.Random(5)
    d = Driver(tiny_checkpoint, kv_cache_tokens=4096, max_num_seqs=1)
    d.s.config = dataclasses.replace(d.s.config, fcfs_fallback_queue=1)
    hot = rand_tokens(rng, 64)
    d.add("warm", hot + [5])
    d.run()
    d.add("cold", rand_tokens(rng, 70))
    d.add("hot", hot + [9, 9])
    d.step()
    assert d.batches[-1] == ["cold"]  # two waiting > 1: arrival order, not the cached one
    d.run()


def test_in_batch_dedup_lets_one_compute_a_shared_prefix_and_the_rest_hit(tiny_checkpoint):
    rng = random.Random(2)
    d = Driver(tiny_checkpoint, kv_cache_tokens=4096)
    head = rand_tokens(rng, 96)
    for i in range(4):
        d.add(f"q{i}", head + rand_tokens(rng, 10))
    d.add("other", rand_tokens(rng, 40))
    d.step()
    assert sorted(d.batches[0]) == ["other", "q0"]  # q1..q3 wait one step for q0's prefix
    d.run()
    assert [d.first[f"q{i}"].cached_tokens for i in range(4)] == [0, 96, 96, 96]
    # prompt tokens computed: each distinct token about once
    assert d.s.prefill_tokens == (96 + 10) + 3 * 10 + 40


def test_chunked_prefill_shares_its_partial_prefix_and_moves_its_lock(tiny_checkpoint):
    rng = random.Random(3)
    d = Driver(tiny_checkpoint, kv_cache_tokens=4096, max_num_batched_tokens=64)
    prompt = rand_tokens(rng, 200)
    d.add("long", prompt)
    d.step()  # first 64-token chunk
    assert d.s.cache.protected_pages == 4 and d.s.cache.evictable_pages == 0
    d.step()
    assert d.s.cache.protected_pages == 8
    d.add("follower", prompt[:128] + [1, 2, 3])
    d.run()
    assert d.first["follower"].cached_tokens == 128
    assert d.s.cache.protected_pages == 0


def test_preemption_under_memory_pressure_keeps_outputs_exact(tiny_checkpoint):
    rng = random.Random(4)
    prompts = [rand_tokens(rng, rng.randint(5, 40)) for _ in range(10)]
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    d = Driver(tiny_checkpoint, kv_cache_tokens=16 * 14)
    for i, p in enumerate(prompts):
        d.add(f"r{i}", p, params)
    d.run()
    assert d.s.num_preemptions > 0
    want = LLM(tiny_checkpoint).generate(prompts, params)
    for i, w in enumerate(want):
        assert d.tokens[f"r{i}"] == w.outputs[0].token_ids
        assert d.finish[f"r{i}"] is FinishReason.LENGTH
    assert d.s.cache.protected_pages == 0


def test_a_request_that_can_never_fit_ends_with_an_error_and_others_go_on(tiny_checkpoint):
    d = Driver(tiny_checkpoint, kv_cache_tokens=16 * 4)
    d.add("huge", list(range(10, 40)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    d.run()
    assert d.finish["huge"] is FinishReason.ERROR and "KV cache exhausted" in str(d.errors["huge"])
    assert len(d.tokens["huge"]) == 64 - 30 + 1  # ran until its KV filled the cache (+ the last sampled token)
    d.add("small", [5, 6, 7])
    d.run()
    assert d.finish["small"] is FinishReason.LENGTH and len(d.tokens["small"]) == 8


def test_long_queue_falls_back_to_fcfs_and_dfs_weight_groups_subtrees():
    alloc = PageAllocator(32)
    cache = RadixCache(alloc, 2)
    cache.insert([1, 1, 2, 2], alloc.alloc(2))
    cache.insert([1, 1, 3, 3], cache.match_prefix([1, 1]).pages + alloc.alloc(1))
    n22 = cache.match_prefix([1, 1, 2, 2]).node
    n33 = cache.match_prefix([1, 1, 3, 3]).node
    root = cache.root()
    cands = [Candidate("lone-root", 0, root, 0, 0.0), Candidate("b1", 4, n33, 0, 1.0),
             Candidate("a1", 4, n22, 0, 2.0), Candidate("b2", 4, n33, 0, 3.0)]
    assert [c.item for c in order(cands, Policy.DFS_WEIGHT)] == ["lone-root", "b1", "b2", "a1"]
    assert [c.item for c in order(cands, Policy.LPM)] == ["b1", "a1", "b2", "lone-root"]
    assert [c.item for c in order(cands, Policy.FCFS)] == ["lone-root", "b1", "a1", "b2"]
    with pytest.raises(ValueError, match="lpm, dfs-weight or fcfs"):
        Policy.parse("fifo")
