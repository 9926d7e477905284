"""Runs the model on one mixed batch over the paged KV cache.

ModelRunner owns the model weights (loaded once) and borrows a KVPool; it knows nothing about requests or
scheduling. forward(chunks) writes each chunk's K/V into the chunk's pages and returns next-token logits for
exactly the positions the chunks asked for, so a long prefill chunk costs one lm_head row, not one per token.
On CUDA a decode-only step replays a CUDA graph (engine_core/cuda_graphs.py) unless the pool has no scratch page
(`--enforce-eager`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from engine_core import kernels
from engine_core.cpu_compile import compile_decoder
from engine_core.cpu_linear import decode_step, prepare_cpu_linears
from engine_core.cuda_graphs import DecodeGraphs
from engine_core.forward_batch import SeqChunk, build_forward_batch
from engine_core.kv_pool import KVPool, torch_dtype
from engine_core.model import DecoderModel
from engine_core.weights import load_q8_0_blocks, load_weights


def _column_major_linear_weights(model: torch.nn.Module) -> None:
    """Store every Linear weight [out, in] transposed in memory (a [in, out] tensor seen through .t()).

    F.linear computes x @ weight.T; with this layout weight.T is a plain row-major matrix, and MKL's GEMM on it
    measured 15-25% faster on the bench model at decode batch sizes (~32 rows, one thread), the same at prefill
    sizes. Values are unchanged; only the memory order is. Embeddings keep their row-major layout (a lookup
    reads rows), so a tied lm_head is left alone. fp32 only, where it was measured (MKL's fp32 GEMM); a bf16 model
    packs every layer (engine_core/cpu_linear.py), and one left to F.linear keeps the checkpoint's order."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


def load_model(config, weight_files, device: torch.device, dtype: torch.dtype,
               prepare: Callable[[DecoderModel], None] | None = None,
               shard: Callable[[str, Tensor], Tensor] | None = None, quantization: str = "none",
               q8_0_file: Path | None = None) -> DecoderModel:
    """The decoder for `config` with its weights from `weight_files`, ready to run on `device`.

    On the CPU its matmuls are prepared once here (engine_core.cpu_linear: the LM head oneDNN-packed, or all int8 with
    `quantization="int8"`, which serves a converted GGUF's `q8_0_file` blocks as they are); Linear layers left to
    F.linear get the column-major layout below.

    Tensor parallelism (engine_core.parallel) passes a per-rank `config`, `prepare` (swaps in the sharded layers
    while the model is still on the meta device) and `shard` (cuts each checkpoint tensor to this rank's part)."""
    # build on the meta device: random init is wasted work, every parameter comes from the checkpoint
    with torch.device("meta"):
        model = DecoderModel(config)
        if prepare is not None:
            prepare(model)
    model = model.to_empty(device=device).to(dtype).eval()
    load_weights(model, weight_files, shard)
    # CPU only; on CUDA it refuses --quantization and does nothing else. A tensor-parallel rank (`prepare`) marks no
    # decode steps, so it keeps no packed decode copies
    blocks = load_q8_0_blocks(model, q8_0_file) if quantization == "int8" and q8_0_file is not None else None
    prepare_cpu_linears(model, quantization, decode_copies=prepare is None, int8_blocks=blocks)
    if device.type == "cpu" and dtype == torch.float32:
        _column_major_linear_weights(model)  # the Linear layers left to F.linear (none, unless packing is off)
    model.build_rope_cache(device)
    return model


class ModelRunner:
    def __init__(self, model_dir, kv_pool: KVPool, device: torch.device | str = "cpu",
                 dtype: torch.dtype | str | None = None, quantization: str = "none", compile: bool | None = None):
        self.config = model_dir.config
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype or self.config.dtype)
        self.kv_pool = kv_pool
        self.max_model_len = self.config.max_position_embeddings
        self.model = load_model(self.config, model_dir.weight_files, self.device, self.dtype,
                                quantization=quantization, q8_0_file=model_dir.q8_0_file)
        # CPU only (`compile`: None is on unless DUET_COMPILE=0), after every weight is in its final form; warmed up
        # on the pool's own caches, whose shapes the graph is specialised to
        compile_decoder(self.model, kv_pool, compile, quantization)
        # CUDA: decode steps replay graphs wherever the pool keeps a scratch page for their padding rows
        self.decode_graphs = (DecodeGraphs(self.model, kv_pool, self.max_model_len)
                              if self.device.type == "cuda" and kv_pool.scratch_page is not None else None)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> Tensor:
        """Logits [sum of len(c.logits_positions)] x vocab, fp32, rows in chunk order then position order."""
        for c in chunks:
            assert c.end_pos <= self.max_model_len, f"position {c.end_pos} beyond the model's {self.max_model_len}"
        graph = self.decode_graphs.shape_for(chunks) if self.decode_graphs is not None else None
        if graph is not None and kernels.kernel_backend(self.decode_graphs.input_ids) == "triton":
            return self.decode_graphs.forward(chunks, graph)
        batch = build_forward_batch(chunks, self.kv_pool.page_size, self.device)
        with decode_step(all(len(c.token_ids) == 1 for c in chunks)):  # CPU matmuls: engine_core/cpu_linear.py
            hidden = self.model(batch.input_ids, batch.positions, batch, self.kv_pool.k_caches,
                                self.kv_pool.v_caches)
        return self.model.compute_logits(hidden[batch.logits_indices])
