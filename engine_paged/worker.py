"""`duet engine paged`: load a checkpoint, size the KV pool, and serve it through the shared
worker (engine_core.worker) with the paged scheduler. Automatic prefix caching is on unless
`--no-enable-prefix-caching`; its KV events hash blocks of one page (GetInfo's hash_block_size)."""

from __future__ import annotations

import argparse

import torch

from engine_core.kv_pool import KVPool, PageAllocator, pages_for_budget
from engine_core.model_runner import ModelRunner
from engine_core.request import EngineSpec
from engine_core.sampler import Sampler
from engine_core.worker import EngineParts, run_worker
from engine_paged.block_manager import BlockManager
from engine_paged.prefix_cache import PrefixCache
from engine_paged.scheduler import PagedScheduler, SchedulerConfig

CAPABILITIES = ("n", "beam_search", "logprobs")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return device


def build_scheduler(pool: KVPool, sampler: Sampler, *, max_model_len: int, eos_token_ids: tuple[int, ...],
                    vocab_size: int, model_id: str, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                    priority: bool = False, enable_prefix_caching: bool = True,
                    watermark: float = 0.01, copy_pages=None) -> PagedScheduler:
    """The paged scheduler over `pool` (the worker, the offline LLM and the benchmarks build it here).
    `copy_pages` defaults to copying within `pool`; tensor parallelism passes one that copies on every rank."""
    copy_pages = copy_pages or pool.copy_pages

    cache = PrefixCache(model_id, pool.page_size) if enable_prefix_caching else None
    block_manager = BlockManager(PageAllocator(pool.num_pages), pool.page_size, watermark=watermark,
                                 prefix_cache=cache)
    config = SchedulerConfig(max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=tuple(eos_token_ids),
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             priority=priority)
    return PagedScheduler(config, block_manager, sampler, copy_pages)


def build_engine(model: str, *, device: str = "cpu", page_size: int = 16, kv_cache_tokens: int | None = None,
                 kv_cache_memory_gb: float | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, priority: bool = False, version: str = "v1",
                 worker_id: str = "paged-0", enable_prefix_caching: bool = True,
                 seed: int | None = None, tensor_parallel_size: int = 1) -> EngineParts:
    """Everything a paged worker runs, built in the calling thread (the worker calls it off the event loop)."""
    from duet.model_dir import read_model_dir

    model_dir = read_model_dir(model)
    config = model_dir.config
    if tensor_parallel_size > 1:
        from engine_core.parallel import start_tensor_parallel

        runner = start_tensor_parallel(model_dir, tensor_parallel_size, device=device, page_size=page_size,
                                       kv_cache_tokens=kv_cache_tokens, kv_cache_memory_gb=kv_cache_memory_gb)
        pool = runner.kv_pool
    else:
        pool = KVPool(config.num_hidden_layers, pages_for_budget(config, page_size, kv_cache_tokens=kv_cache_tokens,
                                                                 kv_cache_memory_gb=kv_cache_memory_gb),
                      page_size, config.num_key_value_heads, config.head_dim, config.dtype, device)
        runner = ModelRunner(model_dir, pool, device)
    num_pages = pool.num_pages
    max_model_len = config.max_position_embeddings
    # the sampler's device is the one every per-request generator is made on (the logits' device)
    sampler = Sampler(config.vocab_size, config.eos_token_ids, runner.device, seed)
    scheduler = build_scheduler(pool, sampler, max_model_len=max_model_len, eos_token_ids=tuple(config.eos_token_ids),
                                vocab_size=config.vocab_size, model_id=model_dir.model_id, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, priority=priority,
                                enable_prefix_caching=enable_prefix_caching,
                                copy_pages=runner.copy_pages if tensor_parallel_size > 1 else None)
    spec = EngineSpec(engine_kind="paged", model_id=model_dir.model_id, version=version, page_size=page_size,
                      max_model_len=max_model_len, capabilities=CAPABILITIES,
                      kv_capacity_tokens=num_pages * page_size, kv_total_pages=num_pages,
                      vocab_size=config.vocab_size, worker_id=worker_id,
                      hash_block_size=page_size if enable_prefix_caching else 0)
    return EngineParts(scheduler, runner, spec)


def main(args: argparse.Namespace) -> int:
    if not args.model:
        from duet.model_make import default_model_dir

        args.model = str(default_model_dir())
    policy = getattr(args, "schedule_policy", None) or "fcfs"
    if policy not in ("fcfs", "priority"):
        raise SystemExit(f"--schedule-policy {policy!r}: the paged engine knows fcfs and priority")
    device = resolve_device(args.device)
    worker_id = args.worker_id or f"{args.host}:{args.port}"

    def build() -> EngineParts:
        return build_engine(args.model, device=device, page_size=args.page_size,
                            kv_cache_tokens=args.kv_cache_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            priority=policy == "priority", version=args.version, worker_id=worker_id,
                            enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))

    return run_worker(build, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                      metrics_port=args.metrics_port, redis_url=getattr(args, "redis", None))
