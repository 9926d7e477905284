"""The collectives a tensor-parallel forward needs, and the layers that call them.

Column-parallel layers need no new class: a rank's qkv_proj and gate_up_proj are plain Linear layers built
with its share of the rows (plan.local_config). Two layers change behaviour:
- RowParallelLinear (o_proj, down_proj): each rank multiplies its slice of the input features; the all-reduce
  sums the partial products into the full output on every rank;
- VocabParallelEmbedding: each rank looks up the ids inside its vocabulary rows, zeros for the others; the
  all-reduce assembles the full embedding. The tied LM head reads the same rows, so each rank computes its
  vocabulary's logits and rank 0 gathers them (Collectives.gather_logits).

Collectives times every all-reduce (its wrapper is the one place they happen), which the engine benchmark
reports as the all-reduce share of a step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine_core.parallel.plan import ShardPlan


class Collectives:
    """torch.distributed calls over the default process group, with their time added up.

    `sync_timing`: on CUDA the collectives are asynchronous, so the wrapper then synchronizes the device around
    each one (slower; only the benchmark turns it on). On CPU (gloo) the calls block and the timing is exact."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.sync_timing = False
        self.all_reduce_seconds = 0.0
        self.all_reduce_calls = 0
        self.gather_seconds = 0.0

    def _sync(self) -> None:
        if self.sync_timing:
            torch.cuda.synchronize(self.device)

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        self._sync()
        start = time.perf_counter()
        dist.all_reduce(t)
        self._sync()
        self.all_reduce_seconds += time.perf_counter() - start
        self.all_reduce_calls += 1
        return t

    def gather_logits(self, local: Tensor, vocab_size: int) -> Tensor | None:
        """Rank 0: every rank's vocabulary slice of the logits [R, local_vocab], side by side and cut to
        [R, vocab_size]. Other ranks send theirs and get None."""
        start = time.perf_counter()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        self.gather_seconds += time.perf_counter() - start
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]


class RowParallelLinear(nn.Linear):
    """x [T, in/tp] (this rank's features) -> [T, out], summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Collectives) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """ids [T] -> [T, H]: rows [vocab_start, vocab_start + num_embeddings) live on this rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int, comm: Collectives) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.comm = comm

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


def shard_layers(model: nn.Module, plan: ShardPlan, comm: Collectives) -> None:
    """Swap the row-parallel and vocab-parallel layers into a DecoderModel built from plan.local_config.
    Run it on the meta device, before the weights are allocated."""
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            setattr(parent, name, RowParallelLinear(old.in_features, old.out_features, old.bias is not None, comm))
    old = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, plan.vocab_start, comm)
