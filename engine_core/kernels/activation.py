"""SiLU-and-mul, the gated MLP activation.

Contract (both implementations): silu_and_mul(x) -> out  # x [T, 2I] = (gate | up); out [T, I] = silu(gate) * up
The reference computes in the input dtype, as HF's `act_fn(gate_proj(x)) * up_proj(x)` does.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from engine_core.kernels._jit import lazy_jit, tl, triton


def silu_and_mul_ref(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
