"""`python -m loadtests.engine_bench prefix [--quick] --json`: engine_prefix on the `bench` checkpoint, CPU.

Engines run in-process (schedule -> forward -> process, no gRPC), every request arriving at t=0.
- Shared-prefix workload (full: 8 groups x 16 requests, a 1,024-token group prompt + a distinct 64-token
  question, 32 output tokens; --quick: 4 x 8, 512 + 64, 16): ``prefill_tokens_ratio`` = prompt tokens the
  engine computed / distinct prompt tokens; ``cache_hit_rate`` = cached prompt tokens / prompt tokens;
  ``ttft_p50_ratio_vs_paged`` = TTFT p50 of engine_prefix over engine_paged's on the same workload, same
  KV budget, token budget and batch limits (engine_paged with its prefix cache; ``paged_no_cache_*`` is the
  same engine with it off, and ``outputs_equal_paged`` checks all three gave the same greedy tokens).
- ``structured_valid_ratio``: json_schema generations (sampled, temperature 1, seeds 0..N-1) that parse and
  validate against the schema.
- ``spec_speedup``: output tokens/s at batch 1 with n-gram speculation (k=4) over without, greedy, on a
  prompt that holds a document followed by the start of an edited copy of it; with ``--model DIR`` (a
  trained model) on the copy/edit chats of copy_edit.py instead, with ``spec_acceptance_rate``.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from pathlib import Path

from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from loadtests.engine_bench.common import bench_checkpoint, bench_device, drive, greedy, prefix_engine

KV_TOKENS = 65536
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}


def shared_prefix_workload(groups: int, per_group: int, head: int, question: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(4, vocab) for _ in range(head)]
        prompts += [prefix + [rng.randrange(4, vocab) for _ in range(question)] for _ in range(per_group)]
    rng.shuffle(prompts)  # groups interleave in the queue, as independent users' requests would
    return prompts


def run_timed(scheduler, runner, requests: list[Request]) -> tuple[dict[str, float], dict[str, list[int]], float]:
    """(TTFT per request in s from the common start, tokens per request, total seconds)."""
    ttft: dict[str, float] = {}

    def first_tokens(now: float, outs) -> None:
        for o in outs:
            if o.token_ids:
                ttft.setdefault(o.request_id, now)

    tokens, secs, _ = drive(scheduler, runner, requests, first_tokens)
    return ttft, {r.request_id: tokens.get((r.request_id, 0), []) for r in requests}, secs


def _shared_prefix(ckpt, quick: bool, vocab: int) -> dict:
    from duet.engine_config import ENGINE_DEFAULTS, EngineConfig, PagedConfig, PrefixConfig
    from engine_paged.worker import build_engine as build_paged
    from engine_prefix.worker import build_engine as build_prefix

    groups, per_group, head, question, out = (4, 8, 512, 64, 16) if quick else (8, 16, 1024, 64, 32)
    prompts = shared_prefix_workload(groups, per_group, head, question, vocab)
    distinct = groups * head + len(prompts) * question
    result: dict = {"shared_prefix_workload": f"{groups}x{per_group} requests, {head}+{question} prompt, {out} out"}
    ttfts = {}
    outputs = {}
    engine = EngineConfig(model=str(ckpt), device=bench_device(), kv_cache_tokens=KV_TOKENS,
                          max_num_seqs=ENGINE_DEFAULTS.max_num_seqs,
                          max_num_batched_tokens=ENGINE_DEFAULTS.max_num_batched_tokens)
    paged_no_cache = functools.partial(build_paged, PagedConfig(engine, enable_prefix_caching=False))
    for kind, build in (("prefix", functools.partial(build_prefix, PrefixConfig(engine))),
                        ("paged", functools.partial(build_paged, PagedConfig(engine))),
                        ("paged_no_cache", paged_no_cache)):
        parts = build()
        reqs = [Request(f"{kind}{i}", p, greedy(out)) for i, p in enumerate(prompts)]
        ttft, tokens, secs = run_timed(parts.scheduler, parts.runner, reqs)
        ttfts[kind] = statistics.median(ttft.values())
        outputs[kind] = [tokens[r.request_id] for r in reqs]
        result[f"{kind}_ttft_p50_s"] = round(ttfts[kind], 3)
        result[f"{kind}_total_s"] = round(secs, 2)
        if kind == "prefix":
            s = parts.scheduler
            result["prefill_tokens"] = s.prefill_tokens
            result["distinct_prompt_tokens"] = distinct
            result["prefill_tokens_ratio"] = round(s.prefill_tokens / distinct, 4)
            result["cache_hit_rate"] = round(s.hits_tokens / max(1, s.queries_tokens), 4)
        if kind == "paged":
            load = parts.scheduler.load()
            result["paged_cache_hit_rate"] = round(load.prefix_cache_hits_tokens /
                                                   max(1, load.prefix_cache_queries_tokens), 4)
    result["ttft_p50_ratio_vs_paged"] = round(ttfts["prefix"] / ttfts["paged"], 4)
    result["outputs_equal_paged"] = outputs["prefix"] == outputs["paged"] == outputs["paged_no_cache"]
    return result


def _structured(ckpt, quick: bool) -> dict:
    import jsonschema

    from duet.engine_config import EngineConfig, PrefixConfig
    from duet.tokenizer import Tokenizer
    from engine_prefix.worker import build_engine

    n = 16 if quick else 50
    parts = build_engine(PrefixConfig(EngineConfig(model=str(ckpt), device=bench_device(), kv_cache_tokens=16384)))
    schema = json.dumps(SCHEMA)
    reqs = [Request(f"s{i}", [10 + i, 11, 12, 13], SamplingParams(max_tokens=128, temperature=1.0, seed=i,
                                                                  json_schema=schema)) for i in range(n)]
    _, tokens, secs = run_timed(parts.scheduler, parts.runner, reqs)
    tok = Tokenizer.from_dir(ckpt)
    valid = 0
    for r in reqs:
        try:
            jsonschema.validate(json.loads(tok.decode(tokens[r.request_id])), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"structured_generations": n, "structured_valid_ratio": valid / n, "structured_total_s": round(secs, 2)}


def _speculative(ckpt, quick: bool, vocab: int) -> dict:

    rng = random.Random(1)
    doc = [rng.randrange(4, vocab) for _ in range(200)]
    edited = doc[:]
    for i in rng.sample(range(len(edited)), 10):  # a few edits
        edited[i] = rng.randrange(4, vocab)
    prompt = doc + [5, 6] + edited[:40]
    out = 48 if quick else 128
    rates, result = {}, {}
    for k in (None, 4):
        parts = prefix_engine(ckpt, num_draft_tokens=k)
        run_timed(parts.scheduler, parts.runner, [Request("warm", prompt, greedy(4))])  # prompt cached for both
        _, tokens, secs = run_timed(parts.scheduler, parts.runner, [Request("r", prompt, greedy(out))])
        rates[k] = len(tokens["r"]) / secs
        if k:
            load = parts.scheduler.load()
            result["spec_draft_tokens"] = load.spec_draft_tokens
            result["spec_accepted_tokens"] = load.spec_accepted_tokens
    result["spec_tok_s_off"] = round(rates[None], 2)
    result["spec_tok_s_on"] = round(rates[4], 2)
    result["spec_speedup"] = round(rates[4] / rates[None], 3)
    return result


def run(quick: bool = False, model: str | None = None) -> dict:
    import torch

    from duet.model_dir import read_model_dir

    ckpt = Path(model) if model else bench_checkpoint()
    vocab = read_model_dir(ckpt).config.vocab_size
    result = {"mode": "prefix", "quick": quick, "device": bench_device(), "torch_threads": torch.get_num_threads()}
    start = time.perf_counter()
    result.update(_shared_prefix(ckpt, quick, vocab))
    result.update(_structured(ckpt, quick))
    if model:  # a trained model: speculation on a copy/edit load of real text
        from loadtests.engine_bench.copy_edit import speculative_on_text

        result["model"] = ckpt.name
        result.update(speculative_on_text(ckpt, quick, run_timed))
    else:
        result.update(_speculative(ckpt, quick, vocab))
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


if __name__ == "__main__":
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv)))
