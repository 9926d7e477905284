"""Which part of the model one tensor-parallel rank holds, and how a checkpoint tensor is cut to that part.

Megatron-style split over `tp` ranks:
- column-parallel (rows of the weight split): q/k/v (by attention head) and gate/up (by intermediate unit);
- row-parallel (columns split, partial sums all-reduced): o_proj and down_proj; a bias stays on rank 0 only,
  so the all-reduce adds it once;
- vocab-parallel: the embedding and the LM head by vocabulary rows, ceil(vocab / tp) per rank (the last rank
  padded with zero rows that no token id reaches and whose logits are cut off);
- norms whole on every rank.

Query heads split evenly. KV heads split too when tp divides them; when there are fewer KV heads than ranks
(tp a multiple of them) each rank keeps the one KV head its query heads attend to, so KV heads are replicated
tp / num_kv_heads times. Every rank's KV pool then holds only its KV heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from engine_core.errors import TensorParallelError


@dataclass(frozen=True)
class ShardPlan:
    tp_size: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        # the KV head of this rank's first query head (GQA groups are contiguous query heads)
        return self.rank * self.local_heads // (self.num_heads // self.num_kv_heads)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    def shard(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the checkpoint tensor `name` (a Hugging Face name)."""
        d = self.head_dim
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return _rows(tensor, self.rank * self.local_heads * d, self.local_heads * d)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return _rows(tensor, self.kv_head_start * d, self.local_kv_heads * d)
        if name.endswith("o_proj.weight"):
            return _columns(tensor, self.rank * self.local_heads * d, self.local_heads * d)
        if name.endswith("o_proj.bias"):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return _rows(tensor, self.rank * self.local_intermediate, self.local_intermediate)
        if name.endswith("down_proj.weight"):
            return _columns(tensor, self.rank * self.local_intermediate, self.local_intermediate)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            part = tensor[self.vocab_start:self.vocab_start + self.local_vocab]
            missing = self.local_vocab - part.shape[0]
            return torch.cat((part, part.new_zeros(missing, *part.shape[1:]))) if missing else part
        return tensor


def _rows(t: Tensor, start: int, n: int) -> Tensor:
    return t[start:start + n]


def _columns(t: Tensor, start: int, n: int) -> Tensor:
    return t[:, start:start + n]


def check_divisible(config, tp_size: int) -> None:
    """TensorParallelError naming both numbers when `tp_size` ranks cannot split this model."""
    if tp_size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size:
        raise TensorParallelError(f"--tensor-parallel-size {tp_size} does not divide the model's {heads} "
                                  f"attention heads")
    if kv % tp_size and tp_size % kv:
        raise TensorParallelError(f"--tensor-parallel-size {tp_size} and the model's {kv} KV heads: one must "
                                  f"divide the other")
    if config.intermediate_size % tp_size:
        raise TensorParallelError(f"--tensor-parallel-size {tp_size} does not divide the model's intermediate "
                                  f"size {config.intermediate_size}")


def shard_plan(config, tp_size: int, rank: int) -> ShardPlan:
    check_divisible(config, tp_size)
    assert 0 <= rank < tp_size
    return ShardPlan(tp_size, rank, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                     config.intermediate_size, config.vocab_size)


def local_config(config, plan: ShardPlan):
    """The model config one rank builds: its heads, intermediate units and vocabulary rows."""
    return dataclasses.replace(config, num_attention_heads=plan.local_heads, num_key_value_heads=plan.local_kv_heads,
                               intermediate_size=plan.local_intermediate, vocab_size=plan.local_vocab)
