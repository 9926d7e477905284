"""Tensor parallelism: one model split over several ranks (processes, one device each) of one worker.

    runner = start_tensor_parallel(model_dir, tp_size, device=..., page_size=..., kv_cache_tokens=...)

returns rank 0's Runner, which the schedulers and the step loop use as they use ModelRunner. The modules:
plan (which rows and columns a rank holds), layers (the collectives and the row/vocab-parallel layers),
shard_runner (one rank's model and KV pool), rank_process (ranks 1..N-1), runner (rank 0 and the start).
"""

from engine_core.parallel.plan import check_divisible
from engine_core.parallel.runner import TensorParallelRunner, start_tensor_parallel

__all__ = ["TensorParallelRunner", "check_divisible", "start_tensor_parallel"]
