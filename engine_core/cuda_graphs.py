"""Decode steps replayed from CUDA graphs: on a GPU an eager decode step is bound by the host, not the device.

A decode step launches a few hundred small kernels (per layer: norms, rope, the K/V store, two attention
kernels, the matmuls); from Python each launch costs microseconds the GPU spends waiting. Measured on an H200
(docs/benchmarks.md, Llama-3.1-8B's shape in bf16): a batch of 64 at 2k context took 16.1 ms eager and 10.2 ms
replayed from a graph (copying the step's inputs in included); a batch of one 20.4 and 5.0 ms. vLLM captures
graphs for the same reason (`--enforce-eager` turns them off there; `--enforce-eager` here too).

One graph per (batch bucket, page-table width bucket), captured the first time a step needs it. Every graph
reads the same static input buffers (views of the largest), so a step copies its tokens, positions, K/V slots,
context lengths and page tables into them and replays. Rows past the step's batch are padding: token 0 at
position 0, attending to one token and storing its K/V in the pool's scratch page (KVPool's `scratch_page`),
which no sequence owns. Only decode-only steps whose every sequence wants one logits row take this path;
prefill and mixed steps (whose shapes vary too much to capture) run eagerly.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import Tensor

from engine_core.forward_batch import ForwardBatch, SeqChunk
from engine_core.kv_pool import KVPool

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_WIDTH_PAGES = 16  # the narrowest page table a graph is captured for (256 tokens at page size 16)


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The smallest captured batch size that holds n sequences, or None past max_batch."""
    buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def width_bucket(pages: int, max_pages: int) -> int | None:
    """Page-table width for a step whose longest sequence needs `pages` pages: the next power of two (at least
    MIN_WIDTH_PAGES, at most max_pages), or None past max_pages. Powers of two keep the graphs few; a wider table
    costs only the decode kernel's empty splits."""
    if pages > max_pages:
        return None
    width = MIN_WIDTH_PAGES
    while width < pages:
        width *= 2
    return min(width, max_pages)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, pool: KVPool, max_model_len: int, max_batch: int = 256):
        if pool.scratch_page is None:
            raise ValueError("CUDA graphs need a KV pool with a scratch page for their padding rows")
        self.model = model
        self.pool = pool
        self.max_batch = max_batch
        self.max_pages = -(-max_model_len // pool.page_size)
        dev = pool.device
        self.scratch_slot = pool.scratch_page * pool.page_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=dev)
        self._no_extend = (torch.zeros(0, 1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                           torch.zeros(0, dtype=torch.int32, device=dev))
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._mempool = None  # one memory pool for every graph, made at the first capture

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def shape_for(self, chunks: list[SeqChunk]) -> tuple[int, int] | None:
        """The (batch, width) graph a step replays, or None if it runs eagerly."""
        if not all(len(c.token_ids) == 1 and len(c.logits_positions) == 1 for c in chunks):
            return None
        batch = batch_bucket(len(chunks), self.max_batch)
        width = width_bucket(max(-(-c.end_pos // self.pool.page_size) for c in chunks), self.max_pages)
        return None if batch is None or width is None else (batch, width)

    def forward(self, chunks: list[SeqChunk], shape: tuple[int, int]) -> Tensor:
        """Logits [len(chunks), vocab] fp32 of a decode step, replayed (captured first if new)."""
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(*shape)
        self._fill(chunks, *shape)
        graph, logits = self._graphs[shape]
        graph.replay()
        # graphs share one memory pool: another graph's replay may reuse this output's memory, so it is copied
        return logits[: len(chunks)].clone()

    def _fill(self, chunks: list[SeqChunk], batch: int, width: int) -> None:
        n, page_size = len(chunks), self.pool.page_size
        pad = batch - n
        ids = [c.token_ids[0] for c in chunks] + [0] * pad
        positions = [c.start_pos for c in chunks] + [0] * pad
        slots = [c.page_table[c.start_pos // page_size] * page_size + c.start_pos % page_size for c in chunks]
        slots += [self.scratch_slot] * pad
        lens = [c.end_pos for c in chunks] + [1] * pad
        tables = np.full((batch, width), self.pool.scratch_page, dtype=np.int32)  # numpy: a row costs ~1 us
        for i, c in enumerate(chunks):
            used = -(-c.end_pos // page_size)
            tables[i, :used] = c.page_table[:used]
        self.input_ids[:batch].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:batch].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:batch, :width].copy_(torch.from_numpy(tables), non_blocking=True)

    def _static_batch(self, batch: int, width: int) -> ForwardBatch:
        extend_tables, cu_seqlens, prefix_lens = self._no_extend
        return ForwardBatch(
            input_ids=self.input_ids[:batch], positions=self.positions[:batch], slot_mapping=self.slots[:batch],
            num_decode_tokens=batch, decode_block_tables=self.block_tables[:batch, :width],
            decode_context_lens=self.context_lens[:batch], extend_block_tables=extend_tables,
            cu_seqlens_q=cu_seqlens, prefix_lens=prefix_lens,
            logits_indices=torch.arange(batch, device=self.pool.device), max_seqlen_q=0)

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        # the warm-up and the capture run on padding rows only: whatever they store lands in the scratch page
        self._fill([], batch, width)
        step = self._static_batch(batch, width)

        def run() -> Tensor:
            hidden = self.model(step.input_ids, step.positions, step, self.pool.k_caches, self.pool.v_caches)
            return self.model.compute_logits(hidden)

        # warm up outside the graph (Triton compiles, cuBLAS picks its kernels), on a side stream as capture wants
        current = torch.cuda.current_stream(self.pool.device)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run()
        current.wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = run()
        return graph, logits
