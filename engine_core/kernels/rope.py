"""Rotary position embedding (Hugging Face / NeoX `rotate_half` layout), standard and Llama-3 scaled.

Contract (both implementations):
  build_rope_cache(head_dim, max_positions, theta, scaling, device, dtype=float32) -> cache [max_positions, head_dim]
      # row p = (cos(p * inv_freq) | sin(p * inv_freq)), each half head_dim // 2 wide
  apply_rope(q, k, positions, cos_sin_cache) -> (q_out, k_out)
      # q [T, Hq, D], k [T, Hk, D], positions [T] int64; x_out = x * cos + rotate_half(x) * sin

`inv_freq` is computed with the same expression, in the same order and precision, as transformers'
`_compute_default_rope_parameters` / `_compute_llama3_parameters`, so fp32 results are bit-identical to HF.
The reference casts cos/sin to the input dtype before rotating, as HF does; the kernel rotates in fp32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, device=None) -> Tensor:
    """The inverse frequencies [head_dim // 2] (fp32), as transformers computes them."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    base = float(theta)
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim)
    )
    kind = None if scaling is None else (scaling.get("rope_type") or scaling.get("type") or "default")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"rope: unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    try:
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
    except KeyError as exc:
        raise ValueError(f"rope: llama3 scaling needs key {exc.args[0]!r}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by the factor, short ones kept, the band between interpolated smoothly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_rope_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    positions = torch.arange(max_positions, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2], same product as HF
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, half by half into one output: the same products and sums as the HF
    formula (bit for bit), without the three concatenations it costs in every layer."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if torch.compiler.is_compiling():
        # inductor fuses this into one loop; the out= views below would break its graph (engine_core.cpu_compile)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out


def apply_rope_ref(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions]  # [T, D]: cos | sin
    cos, sin = rows[:, None, :half], rows[:, None, half:]  # [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@lazy_jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # one program per token: every q and k head of it, the two halves of each head rotated in fp32
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + i, mask=i < half, other=0.0).to(tl.float32)

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    mq = (hq < num_q_heads) & (i < half)
    q1 = tl.load(q_ptr + t * stride_qt + hq * stride_qh + i, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + t * stride_qt + hq * stride_qh + half + i, mask=mq, other=0.0).to(tl.float32)
    qo = q_out_ptr + t * stride_qot + hq * stride_qoh + i
    tl.store(qo, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=mq)
    tl.store(qo + half, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=mq)

    hk = tl.arange(0, BLOCK_HK)[:, None]
    mk = (hk < num_k_heads) & (i < half)
    k1 = tl.load(k_ptr + t * stride_kt + hk * stride_kh + i, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + t * stride_kt + hk * stride_kh + half + i, mask=mk, other=0.0).to(tl.float32)
    ko = k_out_ptr + t * stride_kot + hk * stride_koh + i
    tl.store(ko, (k1 * cos - k2 * sin).to(k_out_ptr.dtype.element_ty), mask=mk)
    tl.store(ko + half, (k2 * cos + k1 * sin).to(k_out_ptr.dtype.element_ty), mask=mk)


def apply_rope_triton(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"apply_rope: q must be [T, Hq, D] and k [T, Hk, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    tokens, _, dim = q.shape
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != dim:
        raise ValueError(f"apply_rope: cos_sin_cache must be [max_positions, {dim}], got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"apply_rope: positions must be [{tokens}] int64, got {positions.dtype} {tuple(positions.shape)}")
    if len({t.device for t in (q, k, positions, cos_sin_cache)}) != 1:
        raise ValueError("apply_rope: all tensors must be on one device")
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )
    if tokens:
        _rope_kernel[(tokens,)](
            q, k, q_out, k_out, positions, cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
            q.shape[1], k.shape[1], dim // 2,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(dim // 2), num_warps=4,
        )
    return q_out, k_out
