"""Paged prefill (extend) attention on CPU over the page cache (csrc/paged_extend.c).

    paged_extend_native(q, k_cache, v_cache, block_tables, q_start, new_lens, prefix_lens, out, scale)

Each chunk's new tokens attend causally over their sequence's keys, cached prefix and own, read where they lie,
in flash attention's order with register-tiled AVX-512 matmuls: 1.8x torch's fused SDPA on a fresh 4 x 512 prefill
of SmolLM2's shape at 2 threads (6.0 against 10.8 ms a layer), and no page gather for a chunk over a cached prefix.
Over a bf16 cache on a CPU with AMX, the matmuls run on the tiles (csrc/paged_extend.c says how): 1.8-1.9x the AVX-512
loops on the same prefill, a bf16 prefill step 0.68-0.72x. Without AMX, on a CPU with AVX512-BF16 (AMD Zen 4 and
5) they run as bf16 dot products (`vdpbf16ps`): 256 new tokens over a 2,000-token prefix 1.7-1.9x the fp32 loops
on a quiet Zen 4 (10.1 against 17.6-18.8 ms a layer at one thread). `cpu_native.extend_bf16_path()` says which runs.
Built and loaded by cpu_native.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.kernels.cpu_native import KV_SUFFIX, library

_KEY_BLOCK = 64  # keys per block in the kernel (KB); its scratch holds every chunk's keys in whole blocks
_ROW_BLOCK = 16  # rows per block: RB, and 16 on AMX (a tile's height)


def paged_extend_native(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, q_start: Tensor,
                        new_lens: Tensor, prefix_lens: Tensor, out: Tensor, scale: float) -> None:
    """Writes the chunks' rows of out [T, Hq, D] (q's shape). q and out contiguous fp32, k_cache and v_cache
    contiguous fp32 or bf16; block_tables [chunks, P], q_start, new_lens and prefix_lens [chunks], all int32 and
    contiguous (the plan makes them so).
    Same result as extend_attention_ref on those rows."""
    lib = library()
    assert lib is not None and q.is_contiguous() and out.is_contiguous() and q.dtype == out.dtype == torch.float32
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.dtype == torch.int32
    hq, d = q.shape[1], q.shape[2]
    hk, page_size = k_cache.shape[2], k_cache.shape[1]
    lens = (prefix_lens + new_lens).tolist()
    threads = torch.get_num_threads()
    key_at = torch.empty(sum(lens), dtype=torch.int64)
    keys_t = torch.empty(sum(-(-n // _KEY_BLOCK) * _KEY_BLOCK for n in lens) * hk * d, dtype=torch.float32)
    rows = torch.empty(threads, _ROW_BLOCK * (_KEY_BLOCK + 2 * d), dtype=torch.float32)
    kernel = getattr(lib, f"paged_extend_{KV_SUFFIX[k_cache.dtype]}")
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
           block_tables.stride(0), q_start.data_ptr(), new_lens.data_ptr(), prefix_lens.data_ptr(),
           len(lens), out.data_ptr(), hq, hk, d, page_size, scale, key_at.data_ptr(),
           keys_t.data_ptr(), rows.data_ptr(), rows.stride(0), threads)
