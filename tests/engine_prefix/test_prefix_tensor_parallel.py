"""engine_prefix with its model split over 2 ranks (CPU, gloo) gives the tokens it gives on one: n-gram
speculation (several logits rows per chunk), a schema-constrained generation, and a prompt that reuses the
radix cache."""

from __future__ import annotations

import json
import random

from duet.engine_config import EngineConfig, PrefixConfig
from engine_core.engine_core import EngineCore
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_prefix.worker import build_engine

SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False})


def _run(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        core.add(r)
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step().outputs:
            assert o.error is None, o.error
            tokens[o.request_id] = tokens.get(o.request_id, []) + list(o.token_ids)
    return tokens


def _serve(checkpoint, tp: int) -> tuple[dict, object]:
    parts = build_engine(PrefixConfig(EngineConfig(model=str(checkpoint), device="cpu", kv_cache_tokens=2048,
                                                   tensor_parallel_size=tp), speculative="ngram", num_draft_tokens=4))
    core = EngineCore(parts.scheduler, parts.runner)
    rng = random.Random(11)
    text = [rng.randrange(3, 1000) for _ in range(60)]
    # prompts that repeat part of themselves: some greedy tokens recur in them, and the n-gram drafts follow
    prompts = [text + text[:8], text[10:] + text[10:20], [7, 8, 9] * 20]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        tokens = _run(core, [Request(f"spec{i}", p, greedy) for i, p in enumerate(prompts)] + [
            Request("json", [5, 6, 7], SamplingParams(max_tokens=24, temperature=1.0, seed=3, json_schema=SCHEMA))])
        tokens |= _run(core, [Request("cached", prompts[0] + [1, 2, 3], greedy)])
        return tokens, parts.scheduler.load()
    finally:
        if tp > 1:
            parts.runner.close()


def test_two_ranks_serve_the_tokens_of_one(tiny_checkpoint):
    want, want_load = _serve(tiny_checkpoint, 1)
    got, load = _serve(tiny_checkpoint, 2)
    assert got == want
    assert load.spec_draft_tokens == want_load.spec_draft_tokens > 0
    assert load.spec_accepted_tokens == want_load.spec_accepted_tokens > 0
    assert load.prefix_cache_hits_tokens == want_load.prefix_cache_hits_tokens >= 64  # the cached prompt's head
    assert got["json"], "the constrained generation produced nothing"
