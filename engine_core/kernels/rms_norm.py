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


@lazy_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # one program per row; the whole row fits in one block (hidden sizes are a few thousand at most)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # the sum is rounded to the input dtype before the statistics, as the HF decoder layer does
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * stride_new_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_args(name: str, x: Tensor, weight: Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight must be [{x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"{name}: x is on {x.device}, weight on {weight.device}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name}: x must be a floating tensor, got {x.dtype}")
    if not weight.is_contiguous():
        raise ValueError(f"{name}: weight must be contiguous")


def _launch(x2: Tensor, res2: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rows, hidden = x2.shape
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x2.dtype), device=x2.device)
    new_res = torch.empty_like(x2) if res2 is not None else x2
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight, out, new_res,
            x2.stride(0), (res2 if res2 is not None else x2).stride(0), out.stride(0), new_res.stride(0),
            hidden, eps,
            HAS_RESIDUAL=res2 is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out, new_res


def _rows(name: str, t: Tensor) -> Tensor:
    # a view when possible; a copy when the last dim is strided
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_norm_args("rms_norm", x, weight)
    out, _ = _launch(_rows("rms_norm", x), None, weight, eps)
    return out.view(x.shape)


def fused_add_rms_norm_triton(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    _check_norm_args("fused_add_rms_norm", x, weight)
    if x.dim() != 2:
        raise ValueError(f"fused_add_rms_norm: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"fused_add_rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got {tuple(residual.shape)}, {residual.dtype}"
        )
    res2 = None if residual is None else _rows("fused_add_rms_norm", residual)
    return _launch(_rows("fused_add_rms_norm", x), res2, weight, eps)
