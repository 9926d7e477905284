"""One decoder-only transformer for the Llama family: Llama (incl. Llama-3 rope scaling), Qwen2 (q/k/v bias)
and Qwen3 (per-head q/k RMSNorm), with optional tied embeddings.

The model computes nothing itself that a kernel owns: norms, rope, activation, KV store and attention all go
through engine_core.kernels. Its forward takes a flat token batch (ForwardBatch) and the per-layer KV caches,
writes every token's K/V into its page slot, then attends over the pages.

Parameter layout (what weights.py fills): q/k/v projections packed in `qkv_proj` [(Hq + 2 Hk) * D, H] and
gate/up in `gate_up_proj` [2 I, H], so each layer runs two input matmuls instead of five.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine_core import attention_op, kernels
from engine_core.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    """Holds the weight; the math is kernels.rms_norm / kernels.fused_add_rms_norm."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Qwen2 puts a bias on q/k/v only; Llama/Qwen3 with attention_bias also on o_proj
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(self.head_dim))
            self.k_norm = nn.Parameter(torch.ones(self.head_dim))

    def project(self, hidden: Tensor, positions: Tensor, rope_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q/k/v of the new tokens, q and k rotated: q [T, Hq, D], k/v [T, Hk, D]."""
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: per-head RMSNorm before rope
            q = kernels.rms_norm(q, self.q_norm, self.eps)
            k = kernels.rms_norm(k, self.k_norm, self.eps)
        q, k = kernels.apply_rope(q, k, positions, rope_cache)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Stores k/v in their page slots, then attends over the step's pages: out [T, Hq * D] (before o_proj)."""
        return torch.ops.duet.paged_attention(q, k, v, k_cache, v_cache, self.scale)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    # The layer is tensor work (norms, residual adds, rope, SiLU-mul and the matmuls) around one opaque attention
    # op, which finds the step's batch itself (engine_core/attention_op.py): so the whole decoder compiles as one
    # graph, and this method, the same code in every layer, is compiled once (engine_core/cpu_compile.py).
    @torch.compiler.nested_compile_region
    def forward(self, hidden: Tensor, residual: Tensor | None, positions: Tensor, rope_cache: Tensor,
                k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """(hidden, residual) after this layer; its new K/V stored in k_cache / v_cache."""
        q, k, v, residual = self.pre_attention(hidden, residual, positions, rope_cache)
        return self.post_attention(self.self_attn.attend(q, k, v, k_cache, v_cache), residual)

    def pre_attention(self, hidden: Tensor, residual: Tensor | None, positions: Tensor, rope_cache: Tensor):
        """(q, k, v, residual): the input norm (with the residual add) and the rotated q/k/v of the new tokens."""
        hidden, residual = self.input_layernorm(hidden, residual)
        return *self.self_attn.project(hidden, positions, rope_cache), residual

    def post_attention(self, out: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(hidden, residual) after o_proj, the post-attention norm (with the residual add) and the MLP."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(out), residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM over a paged KV cache.

    forward(input_ids [T], positions [T], batch, k_caches, v_caches) -> hidden [T, H] (final-normed);
    compute_logits(hidden [R, H]) -> [R, vocab] fp32. Call compute_logits only on the rows that need logits.
    """

    def __init__(self, config, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = max_positions or config.max_position_embeddings
        # the LM head's matmul prepared at load (engine_core.cpu_linear, CPU only); None: F.linear on the weight
        self.head: nn.Module | None = None
        # rope cache is derived, not a weight: rebuilt on device by build_rope_cache()
        self.rope_cache: Tensor | None = None

    def build_rope_cache(self, device) -> None:
        c = self.config
        self.rope_cache = kernels.build_rope_cache(c.head_dim, self.max_positions, c.rope_theta, c.rope_scaling,
                                                   device=device, dtype=torch.float32)

    def forward(self, input_ids: Tensor, positions: Tensor, batch: ForwardBatch, k_caches: list[Tensor],
                v_caches: list[Tensor]) -> Tensor:
        if self.rope_cache is None or self.rope_cache.device != input_ids.device:
            self.build_rope_cache(input_ids.device)
        plan = None
        if kernels.kernel_backend(input_ids) == "torch":  # the same indices in every layer: derive them once
            native = kernels.native_applies(input_ids.device, self.embed_tokens.weight.dtype, k_caches[0].dtype)
            plan = kernels.plan_paged_attention(
                batch.num_decode_tokens, batch.decode_block_tables, batch.decode_context_lens,
                batch.extend_block_tables, batch.cu_seqlens_q, batch.prefix_lens, k_caches[0].shape[1], native)
        with attention_op.step(attention_op.AttentionStep(batch, plan)):
            return self.decoder(self.embed_tokens(input_ids), positions, k_caches, v_caches)

    def decoder(self, hidden: Tensor, positions: Tensor, k_caches: list[Tensor], v_caches: list[Tensor]) -> Tensor:
        """Every layer and the final norm over the embedded tokens, within attention_op.step(): the region
        engine_core.cpu_compile compiles as one graph (it takes only tensors)."""
        residual = torch.zeros_like(hidden)  # not None: the first layer compiles to the same graph as the rest
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            hidden, residual = layer(hidden, residual, positions, self.rope_cache, k_cache, v_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.head is not None:
            return self.head(hidden).float()
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
