"""SiLU-and-mul, the gated MLP activation.

Contract (both implementations): silu_and_mul(x) -> out  # x [T, 2I] = (gate | up); out [T, I] = silu(gate) * up
The reference computes in the input dtype, as HF's `act_fn(gate_proj(x)) * up_proj(x)` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton


def silu_and_mul_ref(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@lazy_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # round silu(gate) to the input dtype before the product, as the two-op reference does
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: Tensor) -> Tensor:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x must be [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"silu_and_mul: x must be a floating tensor, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
        )
    return out
