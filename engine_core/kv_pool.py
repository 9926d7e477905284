"""The KV cache as fixed-size pages, the allocator that hands them out, and the budget that sizes them.

`Allocator` is what both engine kinds' page bookkeeping takes (engine_paged's BlockManager, engine_prefix's
BlockManager and RadixCache); `PageAllocator` is the one implementation.

A page holds `page_size` consecutive token positions of one sequence for every layer, K and V.
Token slot = page * page_size + offset; the kernels address the caches through that slot (store_kv)
and through per-sequence page tables (attention).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Protocol

import torch

from engine_core.errors import CapacityError

DEFAULT_KV_CACHE_TOKENS = 32768

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (a torch.dtype passes through)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


class KVPool:
    """Per-layer K and V caches, each [num_pages (+1 scratch page), page_size, num_kv_heads, head_dim].

    `scratch_page=True` adds one page past the `num_pages` the allocator hands out, `scratch_page` its id: CUDA
    graphs' padding rows store their K/V there (engine_core/cuda_graphs.py); None without it."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | str, device: torch.device | str, scratch_page: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.scratch_page = num_pages if scratch_page else None
        shape = (num_pages + int(scratch_page), page_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of page src into page dst in every layer, for each (src, dst) (copy-on-write)."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for caches in (self.k_caches, self.v_caches):
            for cache in caches:
                cache[dst] = cache[src]


class Allocator(Protocol):
    """Page ids 0..num_total-1 handed out and taken back; the schedulers' only view of the pool's pages."""

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...

    def alloc(self, n: int) -> list[int]:
        """n distinct free pages; CapacityError (and nothing taken) when fewer than n are free."""

    def free(self, pages: Iterable[int]) -> None:
        """Give the pages back (each was allocated and not freed since)."""


class PageAllocator:
    """O(1) alloc/free of page ids 0..num_pages-1 from a free list.

    Invariant (check_integrity): every page is either free or allocated, never both, never lost.
    """

    def __init__(self, num_pages: int):
        self._free: deque[int] = deque(range(num_pages))
        self._in_use = bytearray(num_pages)
        self._num_total = num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._num_total

    def alloc(self, n: int) -> list[int]:
        """n distinct free pages; CapacityError (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            raise CapacityError(f"need {n} KV pages, only {len(self._free)} of {self._num_total} are free")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._in_use[page] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._in_use[page], f"page {page} freed twice or never allocated"
            self._in_use[page] = 0
            self._free.append(page)

    def check_integrity(self) -> None:
        """Raise AssertionError when the free list and the in-use marks disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page appears twice in the free list"
        for page in range(self._num_total):
            assert (page in free) != bool(self._in_use[page]), f"page {page} is both or neither free and in use"


def kv_bytes_per_token(model_config, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of K+V one token occupies across all layers."""
    element = torch.empty((), dtype=torch_dtype(dtype or model_config.dtype)).element_size()
    return 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim * element


def pages_for_budget(model_config, page_size: int, kv_cache_tokens: int | None = None,
                     kv_cache_memory_gb: float | None = None, dtype: torch.dtype | str | None = None) -> int:
    """Number of pages for a budget given in tokens (rounded up to whole pages) or in GiB of KV memory
    (rounded down). Neither given: DEFAULT_KV_CACHE_TOKENS. Both given, or a budget below one page: ValueError.
    """
    if kv_cache_tokens is not None and kv_cache_memory_gb is not None:
        raise ValueError("give a KV cache budget in tokens or in GiB, not both")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if kv_cache_memory_gb is not None:
        per_page = kv_bytes_per_token(model_config, dtype) * page_size
        pages = math.floor(kv_cache_memory_gb * 2**30 / per_page)
        if pages < 1:
            raise ValueError(f"{kv_cache_memory_gb} GiB holds no KV page of {per_page} bytes for this model")
        return pages
    tokens = DEFAULT_KV_CACHE_TOKENS if kv_cache_tokens is None else kv_cache_tokens
    if tokens < 1:
        raise ValueError(f"kv_cache_tokens must be >= 1, got {tokens}")
    return -(-tokens // page_size)
