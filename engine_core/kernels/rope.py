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


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions]  # [T, D]
    cos = torch.cat((rows[:, :half], rows[:, :half]), dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat((rows[:, half:], rows[:, half:]), dim=-1)[:, None, :]
    q_out = q * cos.to(q.dtype) + _rotate_half(q) * sin.to(q.dtype)
    k_out = k * cos.to(k.dtype) + _rotate_half(k) * sin.to(k.dtype)
    return q_out, k_out
