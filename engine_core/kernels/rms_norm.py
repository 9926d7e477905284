"""RMSNorm and fused residual-add + RMSNorm.

Contract (both implementations):
  rms_norm(x, weight, eps) -> out                       # normalizes the last dim of x [..., H]
  fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
      # x [T, H]; new_residual = x + residual (x itself when residual is None); out = rms_norm(new_residual)

The reference follows Hugging Face's LlamaRMSNorm exactly: the statistics are taken in fp32, the normalized
value is cast back to the input dtype, then multiplied by the weight. The residual sum is taken in the input
dtype, as the HF decoder layer does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    new_residual = x if residual is None else x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
