"""`duet engine prefix`: one engine_prefix worker (radix cache, cache-aware scheduling, structured output,
n-gram speculation): the prefix scheduler over the runtime engine_core.builder assembles, served by the shared
worker (engine_core.worker). A request's `priority` orders admission under `--schedule-policy fcfs` (lower
first, then arrival) and breaks ties in `lpm` and `dfs-weight` (engine_prefix/policy.py).

``build_engine(config)`` assembles the parts (tests and benchmarks call it in-process); ``main(config)`` is the CLI.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from duet.contract import HASH_BLOCK_TOKENS, PREFIX, Capability
from duet.engine_config import PrefixConfig
from engine_core.builder import load_runtime
from engine_core.kv_pool import PageAllocator
from engine_core.request import EngineSpec
from engine_core.sampler import Sampler
from engine_core.worker import EngineParts, serve
from engine_prefix.policy import Policy
from engine_prefix.scheduler import PrefixScheduler, PrefixSchedulerConfig
from engine_prefix.speculative import NgramConfig
from engine_prefix.structured import GrammarCache, tokenizer_info


def build_scheduler(config: PrefixConfig, pool, sampler: Sampler, *, max_model_len: int,
                    eos_token_ids: tuple[int, ...], vocab_size: int, model_id: str,
                    grammars: GrammarCache | None = None,
                    clock: Callable[[], float] = time.monotonic) -> PrefixScheduler:
    """The prefix scheduler `config` describes over `pool`'s pages (a KVPool, or anything with its `num_pages`
    and `page_size`): the worker and the fleet simulator build it here. `clock` is the engine's, the one its
    requests' `arrival_time` is on (aging compares the two): time.monotonic in a worker."""
    engine = config.engine
    sched_config = PrefixSchedulerConfig(page_size=pool.page_size, max_num_seqs=engine.max_num_seqs,
                                         max_num_batched_tokens=engine.max_num_batched_tokens,
                                         max_model_len=max_model_len, policy=Policy.parse(config.schedule_policy),
                                         speculative=NgramConfig(config.draft_tokens) if config.draft_tokens else None,
                                         protect_reused=config.cache_eviction == "reuse-aware",
                                         aging_s=config.aging_s)
    return PrefixScheduler(sched_config, PageAllocator(pool.num_pages), sampler, model_id=model_id,
                           vocab_size=vocab_size, eos_token_ids=eos_token_ids, grammars=grammars,
                           hash_block_size=HASH_BLOCK_TOKENS, clock=clock)  # KV events: the gateway's blocks


def build_engine(config: PrefixConfig, seed: int | None = None) -> EngineParts:
    """Load the model and build the scheduler (with the n-gram drafter when `--speculative ngram`)."""
    engine = config.engine
    rt = load_runtime(engine, seed)
    model_dir, cfg = rt.model_dir, rt.model_dir.config
    grammars = None
    if (Path(model_dir.path) / "tokenizer.json").is_file():
        grammars = GrammarCache(tokenizer_info(model_dir.path, cfg.vocab_size, cfg.eos_token_ids))
    max_model_len = cfg.max_position_embeddings
    scheduler = build_scheduler(config, rt.pool, rt.sampler, max_model_len=max_model_len,
                                eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                                model_id=model_dir.model_id, grammars=grammars)
    capabilities = ([Capability.LOGPROBS] + ([Capability.STRUCTURED_OUTPUT] if grammars else [])
                    + ([Capability.SPECULATIVE] if config.draft_tokens else []))
    num_pages = rt.pool.num_pages
    spec = EngineSpec(PREFIX, model_dir.model_id, engine.version, engine.page_size, max_model_len,
                      tuple(capabilities), num_pages * engine.page_size, num_pages, cfg.vocab_size,
                      engine.worker_label, hash_block_size=HASH_BLOCK_TOKENS)
    return EngineParts(scheduler, rt.runner, spec)


def main(config: PrefixConfig) -> int:
    return serve(config.engine, lambda: build_engine(config))
