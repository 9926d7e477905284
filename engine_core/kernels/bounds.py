"""Bounds checks of what the paged kernels index the KV cache with: page tables, lengths, slots and tiles.

The kernels mask by position (a sequence's length), never by page id: a table entry that names a page past the
cache (a pool smaller than the pages its caller hands out), a length past its table row, or a query range past
q's rows makes a kernel read or write outside its tensors. On a GPU that is "an illegal memory access", and CUDA
reports it asynchronously, at a later call (often another kernel's module load), so the traceback names the
wrong kernel (docs/deploy.md, "The illegal memory access in the 2026-12-04 data file").

Checking values needs them on the host: free for CPU tensors (Triton's interpreter), a device sync on a GPU. So
the launchers check CPU tensors always and CUDA tensors only when DUET_KERNEL_CHECKS=1 (debugging), never while
a CUDA graph is being captured. Tiles are checked always (plain integers, no sync).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


def checks_apply(t: Tensor) -> bool:
    """Whether the value checks run for tensors on t's device (see the module docstring)."""
    if not t.is_cuda:
        return True
    if os.environ.get("DUET_KERNEL_CHECKS", "").strip().lower() not in ("1", "true", "yes"):
        return False
    return not torch.cuda.is_current_stream_capturing()


def check_page_tables(name: str, block_tables: Tensor, lengths: Tensor, page_size: int, num_pages: int) -> None:
    """Every sequence's `lengths[i]` tokens fit its table row, and the pages they use (the row's first
    ceil(length / page_size) entries; later entries are ignored by contract) lie inside the cache's pages."""
    lengths = lengths.long()
    width = block_tables.shape[1]
    bad_len = (lengths < 0) | (lengths > width * page_size)
    if bool(bad_len.any()):
        i = int(bad_len.nonzero()[0, 0])
        raise ValueError(f"{name}: sequence {i} has {int(lengths[i])} tokens, but its block-table row holds "
                         f"{width} pages of {page_size} tokens")
    used = torch.arange(width, device=block_tables.device)[None, :] < (-(-lengths // page_size))[:, None]
    bad_page = used & ((block_tables < 0) | (block_tables >= num_pages))
    if bool(bad_page.any()):
        i, j = (int(x) for x in bad_page.nonzero()[0])
        raise ValueError(f"{name}: sequence {i}'s page {j} is page id {int(block_tables[i, j])}, outside the "
                         f"cache's {num_pages} pages")


def check_query_ranges(name: str, cu_seqlens_q: Tensor, num_rows: int, max_seqlen_q: int) -> None:
    """Sequence i's new tokens are q rows cu[i]:cu[i+1]: the ranges must be ordered, inside q, and no longer than
    the `max_seqlen_q` the grid is sized for (a longer one would leave rows of the output unwritten)."""
    cu = cu_seqlens_q.long()
    counts = cu[1:] - cu[:-1]
    if bool((counts < 0).any()) or int(cu[0]) < 0 or int(cu[-1]) > num_rows:
        raise ValueError(f"{name}: cu_seqlens_q {cu.tolist()} must be non-decreasing within q's {num_rows} rows")
    if counts.numel() and int(counts.max()) > max_seqlen_q:
        raise ValueError(f"{name}: a sequence has {int(counts.max())} new tokens, more than max_seqlen_q="
                         f"{max_seqlen_q}")


def check_slots(name: str, slot_mapping: Tensor, num_slots: int) -> None:
    """Every slot lies inside the cache (num_pages * page_size slots)."""
    bad = (slot_mapping < 0) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}: token {t} has slot {int(slot_mapping[t])}, outside the cache's {num_slots} slots")


def tile_problem(block_m: int, block_n: int, warps: int, stages: int) -> str | None:
    """Why a (BLOCK_M, BLOCK_N, warps, stages) tile cannot run, or None: tl.arange needs powers of two, tl.dot
    at least 16 rows and columns, a CUDA block at most 32 warps."""
    for label, size in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if size < 16 or size & (size - 1):
            return f"{label}={size} must be a power of two >= 16"
    if warps < 1 or warps > 32 or warps & (warps - 1):
        return f"num_warps={warps} must be a power of two from 1 to 32"
    if stages < 1:
        return f"num_stages={stages} must be >= 1"
    return None
