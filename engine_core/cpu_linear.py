"""CPU matmuls with their weights prepared once at load: the LM head oneDNN-packed, or int8 weights.

Plain `F.linear` on the CPU hands MKL a plain weight matrix, and MKL re-packs it into its GEMM's blocked layout
inside every call. `PackedLinear` reorders a weight once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and runs oneDNN's inner product on it (`_linear_pointwise`), which
takes any number of rows at run time, so decode (a few rows) and prefill share one packed copy. It serves the
LM head (the tied head keeps its embedding for the lookup and gets a packed copy beside it): 1.6x F.linear at
decode sizes, the same at prefill sizes (loadtests/profiles/matmul_bench.py). The decoder layers keep F.linear
on column-major weights (model_runner.py): packed, they measured at most 1.2x faster at decode and slower at
prefill, and the logits' difference from transformers grew past the real-model tier's 1e-4 (1.4e-4).

`Int8Linear` (`--quantization int8`) keeps each weight as int8 with one scale per output channel (symmetric,
absmax / 127), weight-only: up to 64 rows (decode) `torch._weight_int8pack_mm` multiplies, with bf16
activations (its fp32 path is a slow reference loop), widened back to fp32; a bigger call (prefill) dequantizes
the weight to fp32 for that call, where the kernel measured 0.4x fp32 GEMM. Perplexity on the pydoc topics text: +0.6% over fp32.
Quantizing the activations too measured faster but failed the 2% bound: fbgemm's dynamic int8 GEMM (one scale
per batch) +47%, int8 x int8 `torch._int_mm` with one scale per token +4.2%. The kernel needs the input width
to be a multiple of 16, so narrower layers (the tiny test models') are zero-padded.

`prepare_cpu_linears(model, quantization)` runs at load on the CPU only (a CUDA model keeps cuBLAS, which needs
none of this). Only plain `nn.Linear` layers are swapped: tensor parallelism's row-parallel subclass keeps
F.linear. DUET_CPU_PACKED_WEIGHTS=0 keeps F.linear for the fp32 head (the benchmarks' before/after).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8")


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout, packed once."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # the packing call's row count is only a hint for the layout; any row count runs on the result
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def quantize_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: (int8 [out, in], fp32 scales [out]) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


_INT8_WIDTH = 16  # torch._weight_int8pack_mm crashes on an input width that is not a multiple of this
# above this many rows the kernel's bf16 path is slower than fp32 GEMM (0.4x at 512 rows): a prefill dequantizes
# the weight for the call instead, about 1 ms per matrix against tens of ms saved
_KERNEL_MAX_ROWS = 64


class Int8Linear(nn.Module):
    """y ~= x (q * scale)^T + b: int8 weights, per-output-channel scales, weight-only."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.pad = -self.in_features % _INT8_WIDTH
        self.q = torch.nn.functional.pad(q, (0, self.pad)).contiguous()
        self.scale = scale.float()
        self.kernel_scale = scale.to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None) -> Int8Linear:
        return cls(*quantize_per_channel(weight), bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > _KERNEL_MAX_ROWS:
            weight = self.q[:, :self.in_features].float() * self.scale[:, None]
            return torch.nn.functional.linear(x, weight, self.bias)
        rows = rows.to(torch.bfloat16)
        if self.pad:
            rows = torch.nn.functional.pad(rows, (0, self.pad))
        y = torch._weight_int8pack_mm(rows.contiguous(), self.q, self.kernel_scale).float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def packing_applies(device: torch.device, dtype: torch.dtype, environ=os.environ) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and environ.get("DUET_CPU_PACKED_WEIGHTS", "1") != "0")


def prepare_cpu_linears(model: nn.Module, quantization: str = "none") -> int:
    """Prepare the matmuls of a loaded CPU model: with "int8" every plain Linear and the LM head become
    Int8Linear; else the LM head is packed (`model.head`). Returns how many matmuls were prepared."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    weight = next(model.parameters())
    if quantization != "none" and (weight.device.type != "cpu" or weight.dtype != torch.float32):
        raise ValueError(f"--quantization {quantization} runs on the CPU from fp32 weights only "
                         f"(this model: {weight.dtype} on {weight.device.type})")
    head = model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
    with torch.no_grad():
        if quantization == "int8":
            count = _swap_linears(model)
            model.head = Int8Linear.from_float(head, None)
        elif packing_applies(weight.device, weight.dtype):
            count = 0
            model.head = PackedLinear(head, None)
        else:
            return 0
    if not model.tie_word_embeddings:
        del model.lm_head  # the prepared copy replaces it; a tied head's embedding stays for the lookup
    log.info("CPU matmuls prepared at load: %s", f"{count} layers + LM head int8, weight-only" if count
             else "LM head oneDNN-packed")
    return count + 1


def _swap_linears(model: nn.Module) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name != "lm_head":
                setattr(parent, name, Int8Linear.from_float(child.weight, child.bias))
                count += 1
    return count
