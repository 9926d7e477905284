"""`duet engine paged`: the paged scheduler over the runtime engine_core.builder assembles, served by the
shared worker (engine_core.worker). Automatic prefix caching is on unless `--no-enable-prefix-caching`; its KV
events hash blocks of one page (GetInfo's hash_block_size). `--schedule-policy priority` admits by a request's
`priority` (lower first, FCFS among equals); `fcfs` ignores it. `--max-prefill-tokens-while-decoding` caps the
prompt tokens a step adds while sequences decode; `--max-decode-step-stretch` bounds them in time instead
(engine_paged.scheduler, engine_paged.prefill_budget).

``build_engine(config)`` assembles the parts (tests and benchmarks call it in-process); ``main(config)`` is the CLI.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from duet.contract import KIND_CAPABILITIES, PAGED
from duet.engine_config import PagedConfig
from engine_core.builder import load_runtime
from engine_core.kv_pool import PageAllocator
from engine_core.request import EngineSpec
from engine_core.sampler import Sampler
from engine_core.worker import EngineParts, serve
from engine_paged.block_manager import BlockManager
from engine_paged.prefix_cache import PrefixCache
from engine_paged.scheduler import PagedScheduler, PagedSchedulerConfig


def build_scheduler(config: PagedConfig, pool, sampler: Sampler, *, max_model_len: int,
                    eos_token_ids: tuple[int, ...], vocab_size: int, model_id: str, watermark: float = 0.01,
                    copy_pages: Callable[[list[tuple[int, int]]], None] | None = None) -> PagedScheduler:
    """The paged scheduler `config` describes over `pool` (a KVPool, or anything with its `num_pages`,
    `page_size`, `copy_pages` and `device`, whose type picks the default prefill cap): the worker, the offline LLM
    and the fleet simulator build it here.
    `copy_pages` defaults to copying within `pool`; the worker passes its runtime's (tensor parallelism: one
    that copies on every rank). The scheduler reads no clock (its queue order is the requests' own)."""
    engine = config.engine
    cache = PrefixCache(model_id, pool.page_size) if config.enable_prefix_caching else None
    block_manager = BlockManager(PageAllocator(pool.num_pages), pool.page_size, watermark=watermark,
                                 prefix_cache=cache)
    sched_config = PagedSchedulerConfig(max_model_len=max_model_len, vocab_size=vocab_size,
                                        eos_token_ids=tuple(eos_token_ids), max_num_seqs=engine.max_num_seqs,
                                        max_num_batched_tokens=engine.max_num_batched_tokens,
                                        max_prefill_tokens_while_decoding=config.prefill_tokens_while_decoding(
                                            torch.device(pool.device).type),
                                        max_decode_step_stretch=config.max_decode_step_stretch,
                                        priority=config.schedule_policy == "priority")
    return PagedScheduler(sched_config, block_manager, sampler, copy_pages or pool.copy_pages)


def build_engine(config: PagedConfig, seed: int | None = None) -> EngineParts:
    """Everything a paged worker runs, built in the calling thread (the worker calls it off the event loop)."""
    engine = config.engine
    rt = load_runtime(engine, seed)
    model = rt.model_dir.config
    max_model_len = model.max_position_embeddings
    scheduler = build_scheduler(config, rt.pool, rt.sampler, max_model_len=max_model_len,
                                eos_token_ids=tuple(model.eos_token_ids), vocab_size=model.vocab_size,
                                model_id=rt.model_dir.model_id, copy_pages=rt.copy_pages)
    num_pages = rt.pool.num_pages
    spec = EngineSpec(engine_kind=PAGED, model_id=rt.model_dir.model_id, version=engine.version,
                      page_size=engine.page_size, max_model_len=max_model_len,
                      capabilities=KIND_CAPABILITIES[PAGED],
                      kv_capacity_tokens=num_pages * engine.page_size, kv_total_pages=num_pages,
                      vocab_size=model.vocab_size, worker_id=engine.worker_label,
                      hash_block_size=engine.page_size if config.enable_prefix_caching else 0)
    return EngineParts(scheduler, rt.runner, spec)


def main(config: PagedConfig) -> int:
    return serve(config.engine, lambda: build_engine(config))
