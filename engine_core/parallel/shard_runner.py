"""One tensor-parallel rank's share of the model and of the KV cache, and its forward.

Every rank (rank 0 in the worker process, the others in their own processes) holds a ShardRunner: the decoder
built from plan.local_config with the sharded layers swapped in, its slice of each checkpoint tensor, and a KV
pool of the same pages as every other rank but only its KV heads. `forward` runs the same batch on every rank
(the collectives inside line the ranks up) and returns the full logits on rank 0, None elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.forward_batch import SeqChunk, build_forward_batch
from engine_core.kernels.cpu_native import native_available
from engine_core.kv_pool import KVPool, torch_dtype
from engine_core.model_runner import load_model
from engine_core.parallel.layers import Collectives, shard_layers
from engine_core.parallel.plan import local_config, shard_plan


class ShardRunner:
    def __init__(self, model_dir, tp_size: int, rank: int, num_pages: int, page_size: int,
                 device: torch.device, dtype: torch.dtype | str | None = None) -> None:
        self.config = model_dir.config
        self.plan = shard_plan(self.config, tp_size, rank)
        self.device = device
        self.dtype = torch_dtype(dtype or self.config.dtype)
        self.comm = Collectives(rank, tp_size, device)
        local = local_config(self.config, self.plan)
        self.model = load_model(local, model_dir.weight_files, device, self.dtype,
                                prepare=lambda m: shard_layers(m, self.plan, self.comm), shard=self.plan.shard)
        if device.type == "cpu":
            native_available()  # a first-time compile happens now, not inside a timed collective
        self.kv_pool = KVPool(local.num_hidden_layers, num_pages, page_size, local.num_key_value_heads,
                              local.head_dim, self.dtype, device)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> Tensor | None:
        batch = build_forward_batch(chunks, self.kv_pool.page_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.kv_pool.k_caches, self.kv_pool.v_caches)
        local_logits = self.model.compute_logits(hidden[batch.logits_indices])
        return self.comm.gather_logits(local_logits, self.config.vocab_size)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_pool.copy_pages(pairs)
