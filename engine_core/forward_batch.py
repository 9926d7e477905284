"""One forward pass's worth of sequences, laid out flat for the kernels.

A caller describes each sequence's share of the step as a SeqChunk: a prefill chunk (several new tokens) or one
decode token, plus the sequence's page table. build_forward_batch flattens them: all single-token chunks first
(they go to the paged decode kernel), then the multi-token chunks (the extend kernel). Logit rows come back in
the callers' order regardless: logits_indices points at the flat tokens each chunk asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in this step.

    token_ids: the tokens to run now (>= 1). start_pos: how many tokens of this sequence are already in its
    pages, i.e. the position of token_ids[0]. page_table: the sequence's pages in order, covering at least
    start_pos + len(token_ids) positions. logits_positions: offsets into token_ids whose next-token logits are
    wanted, negative counting from the end; the default is the last token, () asks for none (a prefill chunk
    that is not the prompt's last).
    """

    token_ids: list[int]
    start_pos: int
    page_table: list[int]
    logits_positions: tuple[int, ...] = (-1,)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ForwardBatch:
    """Flat tensors of one step. Tokens [0, num_decode_tokens) are decode rows (one per sequence)."""

    input_ids: Tensor            # [T] int64
    positions: Tensor            # [T] int64
    slot_mapping: Tensor         # [T] int64, page * page_size + offset
    num_decode_tokens: int
    decode_block_tables: Tensor  # [Bd, max_pages] int32
    decode_context_lens: Tensor  # [Bd] int32, tokens in cache including the new one
    extend_block_tables: Tensor  # [Be, max_pages] int32
    cu_seqlens_q: Tensor         # [Be + 1] int32, offsets of each extend chunk within tokens[num_decode_tokens:]
    prefix_lens: Tensor          # [Be] int32, tokens cached before each extend chunk
    logits_indices: Tensor       # [R] int64, flat token rows whose logits the callers asked for, in their order
    max_seqlen_q: int = 0        # longest extend chunk, a host int: the kernel needs no device->host sync per layer

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _block_table(chunks: list[SeqChunk], page_size: int, device) -> Tensor:
    needed = [-(-c.end_pos // page_size) for c in chunks]
    width = max(needed, default=0) or 1
    # padding entries are never read: the kernels stop at each row's own length
    rows = [c.page_table[:n] + [0] * (width - n) for c, n in zip(chunks, needed)]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width).to(device, non_blocking=True)


def build_forward_batch(chunks: list[SeqChunk], page_size: int, device: torch.device | str) -> ForwardBatch:
    assert chunks, "a forward batch needs at least one chunk"
    for c in chunks:
        assert c.token_ids, "a chunk needs at least one token"
        assert len(c.page_table) * page_size >= c.end_pos, (
            f"page table of {len(c.page_table)} pages cannot hold {c.end_pos} tokens")
    decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    extend = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    flat_start = [0] * len(chunks)
    cu_seqlens = [0]
    for i in decode + extend:
        c = chunks[i]
        flat_start[i] = len(input_ids)
        input_ids.extend(c.token_ids)
        for pos in range(c.start_pos, c.end_pos):
            positions.append(pos)
            slots.append(c.page_table[pos // page_size] * page_size + pos % page_size)
        if len(c.token_ids) > 1:
            cu_seqlens.append(cu_seqlens[-1] + len(c.token_ids))
    logits_indices = []
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        for offset in c.logits_positions:
            assert -n <= offset < n, f"logits position {offset} outside a chunk of {n} tokens"
            logits_indices.append(flat_start[i] + offset % n)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        num_decode_tokens=len(decode),
        decode_block_tables=_block_table([chunks[i] for i in decode], page_size, device),
        decode_context_lens=tensor([chunks[i].end_pos for i in decode], torch.int32),
        extend_block_tables=_block_table([chunks[i] for i in extend], page_size, device),
        cu_seqlens_q=tensor(cu_seqlens, torch.int32),
        prefix_lens=tensor([chunks[i].start_pos for i in extend], torch.int32),
        logits_indices=tensor(logits_indices, torch.int64),
        max_seqlen_q=max((len(chunks[i].token_ids) for i in extend), default=0),
    )
