"""`duet engine prefix`: one engine_prefix worker (radix cache, cache-aware scheduling, structured output,
n-gram speculation) on the shared serving loop of engine_core.

``build_engine`` assembles the parts (tests and benchmarks call it in-process); ``main(args)`` is the CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from duet.model_dir import read_model_dir
from engine_core.kv_pool import KVPool, PageAllocator, pages_for_budget
from engine_core.model_runner import ModelRunner
from engine_core.request import EngineSpec
from engine_core.sampler import Sampler
from engine_core.worker import EngineParts, run_worker
from engine_prefix.policy import Policy
from engine_prefix.scheduler import PrefixScheduler, PrefixSchedulerConfig
from engine_prefix.speculative import NgramConfig
from engine_prefix.structured import GrammarCache, tokenizer_info

# KV events hash blocks of this many tokens: the gateway's block size (duet.hashing), reported in GetInfo.
HASH_BLOCK_SIZE = 16


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_engine(model: str | Path, *, device: str = "cpu", page_size: int = 16, kv_cache_tokens: int | None = None,
                 kv_cache_memory_gb: float | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, schedule_policy: str | None = None,
                 num_draft_tokens: int | None = None, version: str = "v1", worker_id: str = "prefix-0",
                 seed: int | None = None, tensor_parallel_size: int = 1) -> EngineParts:
    """Load the model and build the scheduler. ``num_draft_tokens`` None: no speculation."""
    model_dir = read_model_dir(model)
    cfg = model_dir.config
    dev = resolve_device(device)
    if tensor_parallel_size > 1:
        from engine_core.parallel import start_tensor_parallel

        runner = start_tensor_parallel(model_dir, tensor_parallel_size, device=dev, page_size=page_size,
                                       kv_cache_tokens=kv_cache_tokens, kv_cache_memory_gb=kv_cache_memory_gb)
        num_pages = runner.kv_pool.num_pages
    else:
        num_pages = pages_for_budget(cfg, page_size, kv_cache_tokens=kv_cache_tokens,
                                     kv_cache_memory_gb=kv_cache_memory_gb)
        pool = KVPool(cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype,
                      dev)
        runner = ModelRunner(model_dir, pool, dev)
    grammars = None
    if (Path(model_dir.path) / "tokenizer.json").is_file():
        grammars = GrammarCache(tokenizer_info(model_dir.path, cfg.vocab_size, cfg.eos_token_ids))
    spec_cfg = NgramConfig(num_draft_tokens) if num_draft_tokens else None
    max_model_len = cfg.max_position_embeddings
    config = PrefixSchedulerConfig(page_size=page_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   policy=Policy.parse(schedule_policy), speculative=spec_cfg)
    # the sampler's device (the runner's, where the logits are) is the one every generator is made on
    sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, runner.device, seed)
    scheduler = PrefixScheduler(config, PageAllocator(num_pages), sampler,
                                model_id=model_dir.model_id, vocab_size=cfg.vocab_size,
                                eos_token_ids=cfg.eos_token_ids, grammars=grammars, hash_block_size=HASH_BLOCK_SIZE)
    capabilities = ["logprobs"] + (["structured_output"] if grammars else []) + (["speculative"] if spec_cfg else [])
    spec = EngineSpec("prefix", model_dir.model_id, version, page_size, max_model_len, tuple(capabilities),
                      num_pages * page_size, num_pages, cfg.vocab_size, worker_id, hash_block_size=HASH_BLOCK_SIZE)
    return EngineParts(scheduler, runner, spec)


def main(args: argparse.Namespace) -> int:
    if args.model is None:
        from duet.model_make import default_model_dir

        args.model = str(default_model_dir())
    try:
        Policy.parse(args.schedule_policy)  # a typo fails before the model loads
    except ValueError as exc:
        raise SystemExit(f"--schedule-policy: {exc}") from None

    def build() -> EngineParts:
        return build_engine(
            args.model, device=args.device, page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
            kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, schedule_policy=args.schedule_policy,
            num_draft_tokens=args.num_draft_tokens if args.speculative == "ngram" else None,
            version=args.version, worker_id=args.worker_id or f"{args.host}:{args.port}",
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))

    return run_worker(build, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                      metrics_port=args.metrics_port, redis_url=getattr(args, "redis", None))
