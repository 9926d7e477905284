"""The one place an engine's runtime is assembled: device, model, KV pool, model runner and sampler.

Both engine kinds build through `load_runtime(config)` and add only their scheduler (engine_paged/worker.py,
engine_prefix/worker.py); the offline LLM (engine_core/llm.py) sizes its own pool and builds through
`build_runtime`. `resolve_device` is the one reading of `--device` for every kind: `auto` is CUDA when a
device is visible, else the CPU; CUDA asked for where none is visible is a `DeviceError` (engine_core.worker's
`serve` checks it before the port opens).

`--tensor-parallel-size N` > 1 is chosen here too: `load_runtime` starts the ranks
(engine_core.parallel.start_tensor_parallel) and its runtime's runner is rank 0's TensorParallelRunner, whose
`copy_pages` copies on every rank; the engine workers see only `Runtime` and stay free of tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duet.auto_dtype import describe, resolve_dtype
from duet.engine_config import EngineConfig
from duet.model_dir import ModelDir, read_model_dir
from engine_core.errors import DeviceError
from engine_core.kv_pool import KVPool, pages_for_budget
from engine_core.model_runner import ModelRunner
from engine_core.sampler import Sampler

log = logging.getLogger(__name__)


def resolve_device(name: str | torch.device) -> torch.device:
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {name}: no CUDA device is visible")
    return device


@dataclass
class Runtime:
    """What every engine kind runs on; its scheduler is the kind's own."""

    model_dir: ModelDir
    runner: ModelRunner  # or TensorParallelRunner (rank 0); either owns the KV pool (runner.kv_pool)
    sampler: Sampler  # on the runner's device, where the logits are: every generator is made there
    # copy-on-write of KV pages: None is within runner.kv_pool; tensor parallelism copies on every rank's pool
    copy_pages: Callable[[list[tuple[int, int]]], None] | None = None

    def __post_init__(self) -> None:
        if self.copy_pages is None:
            self.copy_pages = self.pool.copy_pages

    @property
    def pool(self) -> KVPool:
        return self.runner.kv_pool


def new_pool(model_dir: ModelDir, num_pages: int, page_size: int, device: torch.device,
             dtype: torch.dtype | str | None = None, scratch_page: bool = False) -> KVPool:
    c = model_dir.config
    return KVPool(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim, dtype or c.dtype,
                  device, scratch_page)


def build_runtime(model_dir: ModelDir, *, device: str | torch.device, page_size: int, num_pages: int,
                  dtype: torch.dtype | str | None = None, seed: int | None = None,
                  quantization: str = "none", compile: bool | None = None, enforce_eager: bool = False) -> Runtime:
    """Pool, runner (weights loaded, prepared for the CPU: engine_core.cpu_linear, compiled:
    engine_core.cpu_compile; on CUDA decode steps replayed from graphs unless `enforce_eager`:
    engine_core.cuda_graphs) and sampler for `model_dir` on `device` (resolved here)."""
    dev = resolve_device(device)
    graphs = dev.type == "cuda" and not enforce_eager
    runner = ModelRunner(model_dir, new_pool(model_dir, num_pages, page_size, dev, dtype, scratch_page=graphs), dev,
                         dtype, quantization, compile)
    c = model_dir.config
    return Runtime(model_dir, runner, Sampler(c.vocab_size, c.eos_token_ids, runner.device, seed))


def load_runtime(config: EngineConfig, seed: int | None = None) -> Runtime:
    """The runtime a worker's config describes: its model (the tiny default when none), KV budget, device."""
    if config.model is None:
        from duet.model_make import default_model_dir

        config = dataclasses.replace(config, model=str(default_model_dir()))
    model_dir = read_model_dir(config.model)
    if config.tensor_parallel_size > 1:
        return _tensor_parallel_runtime(model_dir, config, seed)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device).type)
    log.info("%s", describe(config.dtype, dtype))
    num_pages = pages_for_budget(model_dir.config, config.page_size, kv_cache_tokens=config.kv_cache_tokens,
                                 kv_cache_memory_gb=config.kv_cache_memory_gb, dtype=dtype)
    return build_runtime(model_dir, device=config.device, page_size=config.page_size, num_pages=num_pages,
                         dtype=dtype, seed=seed, quantization=config.quantization, compile=config.compile,
                         enforce_eager=config.enforce_eager)


def _tensor_parallel_runtime(model_dir: ModelDir, config: EngineConfig, seed: int | None) -> Runtime:
    """Ranks 1..N-1 started as processes, rank 0 loaded here; the KV budget is per rank (its own KV heads)."""
    from engine_core.parallel import start_tensor_parallel  # torch.distributed only for a worker that splits

    runner = start_tensor_parallel(model_dir, config.tensor_parallel_size, device=resolve_device(config.device),
                                   page_size=config.page_size, kv_cache_tokens=config.kv_cache_tokens,
                                   kv_cache_memory_gb=config.kv_cache_memory_gb)
    c = model_dir.config
    return Runtime(model_dir, runner, Sampler(c.vocab_size, c.eos_token_ids, runner.device, seed),
                   copy_pages=runner.copy_pages)
