"""CPU matmuls with their weights prepared once at load: oneDNN-packed copies, or int8 weights.

Plain `F.linear` on the CPU hands MKL a plain weight matrix, and MKL re-packs it into its GEMM's blocked layout
inside every call. `PackedLinear` reorders a weight once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and runs oneDNN's inner product on it (`_linear_pointwise`), which
takes any number of rows at run time, so decode (a few rows) and prefill share one packed copy. It serves the
LM head (the tied head keeps its embedding for the lookup and gets a packed copy beside it): 1.6x F.linear at
decode sizes, the same at prefill sizes (loadtests/profiles/matmul_bench.py).

The decoder layers are `DecodePackedLinear`: the column-major weight F.linear runs fastest on (model_runner.py)
plus a packed copy that the matmuls of a decode step of 2 to 32 rows take (`decode_step()`, set by the model
runner when every sequence brings one token). There the packed copy measured 1.1-1.7x F.linear (MKL's GEMM
re-packs a plain weight inside every call); at one row MKL's GEMV, and at prefill sizes its GEMM, are as fast or
faster, so those keep the plain weight. Prefill keeps it at every size too: oneDNN sums in another order, which
moved SmolLM2's logits 1.4e-4 from transformers' (1.1e-4 on an AMD EPYC), past the real-model tier's 1e-4 for
prefill (decode rows already differ from a full forward by more, and that tier allows them 5e-4).
DUET_CPU_PACKED_PREFILL=1 sends prefill calls (2 rows and more) to the packed copy as well: off by default for
that parity, it is where MKL's GEMM is the slower one, as on AMD CPUs (a 512-token prefill step 1.2-1.3x
faster on a Zen 4 EPYC, docs/benchmarks.md, measured before engine_core/mkl_on_amd.py gave MKL its fast kernels
there), at the cost of the tier's prefill bound. The copy doubles the layers' weight memory
(425 MB on SmolLM2-135M in fp32) and took a served decode step from 76 to 64 ms (docs/benchmarks.md).
The choice runs inside one custom op, `duet::cpu_linear`, so a compiled layer (engine_core/cpu_compile.py) keeps
one graph for every batch size: inductor calls the op and never sees the oneDNN tensor it cannot trace.

A bf16 model (`--dtype bfloat16`, or `auto` on a CPU with AMX or AVX512_BF16) makes every plain Linear a
`BF16PackedLinear`, whose weight lives only in prepared copies: its `weight` is a one-element stand-in seen as
[out, in] whose address finds oneDNN's copy (what duet::cpu_linear takes). Without AMX, on AVX512_BF16, Duet's
kernel's panels serve every call (kernels/cpu_bf16_linear.py). On AMX oneDNN's bf16 inner product on a packed
copy runs on the tiles and measured 1.2x F.linear on the bf16 weight at 16 rows; Duet's kernel on the tiles
measured 1.1-1.6x oneDNN up to 64 rows and fell behind from about 128 (matmul_bench, docs/benchmarks.md), so the
layers keep both copies and duet::cpu_linear takes the panels for calls of up to PANEL_ROWS rows (decode steps),
oneDNN's copy for the rest (prefill): one more bf16 copy of the layers' weights. Where the CPU has neither (no
AVX512_BF16), only oneDNN's copy. There is no transformers parity to keep in bf16 (two bf16 kernels round
differently anyway): the real-model tier holds bf16 to fp32's perplexity instead (tests/realmodel/test_real_bf16.py).

`Int8Linear` (`--quantization int8`) keeps each weight as int8 with one scale per output channel (symmetric,
absmax / 127), weight-only. Where the CPU has AVX512_BF16 every call, decode or prefill, runs Duet's kernel
(kernels/cpu_int8_linear.py: the weights widened to bf16 in registers, bf16 activations, fp32 sums), 1.8x the
packed fp32 layers at 16 rows and 1.67x F.linear at 512 on a Zen 4 EPYC (docs/benchmarks.md). On other CPUs with
AVX2 and FMA every call runs Duet's fp32 kernel (kernels/cpu_int8_grouped.py, one scale group per row: the weights
dequantized in registers, fp32 activations), 1.1-1.4x the packed fp32 layers at 16 rows on a Zen 3. Without either
(no C compiler, DUET_NATIVE_CPU_INT8=0) torch's `torch._weight_int8pack_mm` multiplies up to 64 rows (decode),
with bf16 activations (its fp32 path is a slow reference loop), widened back to fp32; a bigger call (prefill)
dequantizes the weight to fp32 for that call, where torch's kernel measured 0.4x fp32 GEMM. `GroupedInt8Linear`
serves a GGUF's Q8_0 blocks (one scale per 32 weights of a row) as they are, on the fp32 kernel. Perplexity on
the pydoc topics text: +0.5-0.7% over fp32 on every path (docs/benchmarks.md).
Quantizing the activations too measured faster but failed the 2% bound: fbgemm's dynamic int8 GEMM (one scale
per batch) +47%, int8 x int8 `torch._int_mm` with one scale per token +4.2%. Torch's kernel needs the input width
to be a multiple of 16, so narrower layers (the tiny test models') are zero-padded.

`prepare_cpu_linears(model, quantization)` runs at load on the CPU only (a CUDA model keeps cuBLAS, which needs
none of this). Only plain `nn.Linear` layers are swapped: tensor parallelism's row-parallel subclass keeps
F.linear. DUET_CPU_PACKED_WEIGHTS=0 keeps F.linear everywhere (the benchmarks' before/after, and in fp32 half the
weight memory); so does a bf16 model on a CPU oneDNN has no bf16 path for (no AVX-512).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from engine_core import mkl_on_amd
from engine_core.kernels import cpu_bf16_linear, cpu_int8_grouped, cpu_int8_linear

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


# the rows of a decode step: where the packed copy beats F.linear on the column-major weight (module docstring)
PACKED_ROWS = range(2, 33)
_step = threading.local()  # .decode: the running forward is a decode step (read inside duet::cpu_linear)


@contextmanager
def decode_step(active: bool):
    """Within it, DecodePackedLinear's decode-sized calls take the packed copy (when `active`)."""
    before = getattr(_step, "decode", False)
    _step.decode = active
    try:
        yield
    finally:
        _step.decode = before
# the packed copy of each DecodePackedLinear weight, by the weight's address: a compiled graph passes the weight
# tensor to duet::cpu_linear, never the module, and an mkldnn tensor cannot be a graph input. Each entry holds a
# weak reference to its weight and is dropped with it, so a freed address never finds a stale copy.
_PACKED_COPIES: dict[int, tuple[weakref.ref, Tensor]] = {}


def _packed_copy(weight: Tensor) -> Tensor | None:
    entry = _PACKED_COPIES.get(weight.data_ptr())
    if entry is None or entry[0]() is None:
        return None
    return entry[1]


# DUET_CPU_PACKED_PREFILL=1 (read at import, as the workers start): every call of 2 rows or more takes the packed copy
_PACKED_PREFILL = os.environ.get("DUET_CPU_PACKED_PREFILL", "0") == "1"


# a bf16 call of at most this many rows takes Duet's AMX kernel where the layer has its panels (BF16PackedLinear)
PANEL_ROWS = 64


def _cpu_linear(x: Tensor, weight: Tensor, bias: Tensor | None, panels: Tensor | None = None) -> Tensor:
    """x W^T + b: through W's packed copy in a decode step of PACKED_ROWS rows (with DUET_CPU_PACKED_PREFILL=1, in
    any call of 2 rows or more), else F.linear on W itself. A bf16 W is a stand-in: its panels for calls of up to
    PANEL_ROWS rows where it has them, else its packed copy."""
    rows = x.numel() // x.shape[-1]
    if weight.dtype == torch.bfloat16:
        if panels is not None and rows <= PANEL_ROWS:
            return cpu_bf16_linear.bf16_linear_native(x, panels, bias, weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, _packed_copy(weight), bias, "none", [], "")
    use = rows >= 2 if _PACKED_PREFILL else getattr(_step, "decode", False) and rows in PACKED_ROWS
    packed = _packed_copy(weight) if use else None
    if packed is None:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# registered with torch.library's low-level API rather than @custom_op, whose wrapper (argument checks on every
# call) cost 8 us of a 25 us decode-sized call, 120 calls a step
_LIBRARY = torch.library.Library("duet", "DEF")
_LIBRARY.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? panels=None) -> Tensor")
_LIBRARY.impl("cpu_linear", _cpu_linear, "CPU")


@torch.library.register_fake("duet::cpu_linear")
def _cpu_linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None, panels: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _keep_packed_copy(key: Tensor, weight: Tensor) -> None:
    """Pack `weight` and file the copy under `key`'s address for as long as `key` lives."""
    address = key.data_ptr()

    def forget(ref: weakref.ref) -> None:
        if _PACKED_COPIES.get(address, (None,))[0] is ref:
            del _PACKED_COPIES[address]

    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)
    _PACKED_COPIES[address] = (weakref.ref(key, forget), packed)


class DecodePackedLinear(nn.Module):
    """y = x W^T + b with W column-major, and a oneDNN-packed copy of W for decode-sized calls."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        _keep_packed_copy(self.weight, weight)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.duet.cpu_linear(x, self.weight, self.bias)


class BF16PackedLinear(nn.Module):
    """y = x W^T + b in bf16, on prepared copies of W: the panels of Duet's bf16 kernel (kernels/cpu_bf16_linear.py)
    for every call where the CPU has AVX512_BF16 and no AMX; oneDNN's packed layout where it has neither. On AMX
    both: Duet's kernel runs calls of up to PANEL_ROWS rows on the tiles at 1.1-1.6x oneDNN's speed (decode steps;
    loadtests/profiles/matmul_bench.py, docs/benchmarks.md) and falls behind from about 128 rows (prefill), which
    oneDNN takes; the second copy costs one more bf16 copy of the layers' weights. The LM head (`fp32_out`) runs
    only Duet's kernel where it can, for its fp32 logits. `weight` is a one-element stand-in of W's shape (for
    oneDNN, the key to its copy)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, fp32_out: bool = False):
        super().__init__()
        assert weight.dtype == torch.bfloat16, weight.dtype
        self.out_features, self.in_features = weight.shape
        self.fp32_out = fp32_out  # the LM head on Duet's kernel: logits keep their fp32 sums (no bf16 ties)
        self.weight = nn.Parameter(weight.new_empty(1).expand(weight.shape), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        native = cpu_bf16_linear.serves_width(self.in_features)
        self.register_buffer("panels", cpu_bf16_linear.pack_bf16(weight) if native else None, persistent=False)
        # oneDNN's copy: for every call without panels, for the big calls beside the AMX panels (not the head's)
        self.onednn = not native or not (fp32_out or cpu_bf16_linear.serves_here())
        if self.onednn:
            _keep_packed_copy(self.weight, weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.onednn:
            return torch.ops.duet.cpu_linear(x, self.weight, self.bias, self.panels)
        return torch.ops.duet.bf16_linear(x, self.panels, self.bias, self.out_features, self.fp32_out)


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

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None, native: bool | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        # buffers, not plain attributes: a compiled decoder takes them as graph inputs, so every layer shares a graph
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        # native (None: where the CPU has a vector loop of one of Duet's kernels), else torch's kernel
        bf16 = cpu_int8_linear.vector_path()
        self.native = (bf16 or cpu_int8_grouped.vector_path()) if native is None else native
        if self.native and bf16:  # the bf16-dot kernel (kernels/cpu_int8_linear.py), at every row count
            self.register_buffer("packed", cpu_int8_linear.pack_int8(q))
            self.group = None
            return
        if self.native:  # fp32 FMAs, the weights dequantized in registers (kernels/cpu_int8_grouped.py): one group
            self.group = self.in_features
            packed, packed_scales = cpu_int8_grouped.pack_grouped(q, self.scale[:, None])
            self.register_buffer("packed", packed)
            self.register_buffer("packed_scales", packed_scales)
            return
        self.pad = -self.in_features % _INT8_WIDTH
        self.q = torch.nn.functional.pad(q, (0, self.pad)).contiguous()
        self.kernel_scale = scale.to(torch.bfloat16)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, native: bool | None = None) -> Int8Linear:
        return cls(*quantize_per_channel(weight), bias, native)

    def forward(self, x: Tensor) -> Tensor:
        if self.native and self.group is None:
            return torch.ops.duet.int8_linear(x, self.packed, self.scale, self.bias, self.out_features)
        if self.native:
            return torch.ops.duet.int8_grouped_linear(x, self.packed, self.packed_scales, self.group, self.bias,
                                                      self.out_features)
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


class GroupedInt8Linear(nn.Module):
    """y = x (q * s)^T + b: int8 weights with one scale per `group` input columns, as a GGUF Q8_0 file stores them
    (blocks of 32), served as they are: Duet's kernel dequantizes them in registers (kernels/cpu_int8_grouped.py).
    Without the kernel (no C compiler, or DUET_NATIVE_CPU_INT8=0) each call dequantizes the weight for itself."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group = self.in_features // scale.shape[1]
        if scale.shape[0] != q.shape[0] or self.group * scale.shape[1] != self.in_features:
            raise ValueError(f"int8 weight {tuple(q.shape)} does not split into groups of scales {tuple(scale.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.native = cpu_int8_grouped.library() is not None
        if self.native:
            packed, packed_scales = cpu_int8_grouped.pack_grouped(q, scale)
            self.register_buffer("packed", packed)
            self.register_buffer("packed_scales", packed_scales)
        else:
            self.register_buffer("q", q.contiguous())
            self.register_buffer("scale", scale.float().contiguous())

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, group: int = 32) -> GroupedInt8Linear:
        """Quantized as llama.cpp's Q8_0 does: per `group` weights of a row, scale = absmax / 127 as fp16."""
        w = weight.detach().float().reshape(weight.shape[0], -1, group)
        scale = (w.abs().amax(dim=2) / 127.0).half().float()
        q = torch.round(w / scale.clamp(min=1e-12)[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(weight.shape), scale, bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.native:
            return torch.ops.duet.int8_grouped_linear(x, self.packed, self.packed_scales, self.group, self.bias,
                                                      self.out_features)
        weight = self.q.float() * self.scale.repeat_interleave(self.group, dim=1)
        return torch.nn.functional.linear(x, weight, self.bias)


def packing_applies(device: torch.device, dtype: torch.dtype, environ=os.environ) -> bool:
    """Whether a model of `dtype` on `device` gets oneDNN-packed matmuls: fp32, or bf16 where oneDNN has a bf16
    path on this CPU (AVX-512 or newer), on the CPU, unless DUET_CPU_PACKED_WEIGHTS=0."""
    packable = dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return (device.type == "cpu" and packable and torch.backends.mkldnn.is_available()
            and environ.get("DUET_CPU_PACKED_WEIGHTS", "1") != "0")


def prepare_cpu_linears(model: nn.Module, quantization: str = "none", decode_copies: bool = True,
                        int8_blocks: dict[str, tuple[Tensor, Tensor]] | None = None) -> int:
    """Prepare the matmuls of a loaded CPU model: with "int8" every plain Linear and the LM head become
    Int8Linear, or GroupedInt8Linear where `int8_blocks` holds the weight's Q8_0 blocks (by parameter name:
    engine_core/weights.py load_q8_0_blocks); in fp32 every plain Linear becomes a DecodePackedLinear (unless not
    `decode_copies`: a tensor-parallel rank, whose runner marks no decode steps) and the LM head is packed
    (`model.head`); in bf16 every plain Linear becomes a BF16PackedLinear and the head is packed. Returns how many
    matmuls were prepared."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    weight = next(model.parameters())
    if quantization != "none" and (weight.device.type != "cpu" or weight.dtype != torch.float32):
        raise ValueError(f"--quantization {quantization} runs on the CPU from fp32 weights only "
                         f"(this model: {weight.dtype} on {weight.device.type})")
    head = model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
    with torch.no_grad():
        if quantization == "int8":
            blocks = int8_blocks or {}

            def int8(name: str, weight: Tensor, bias: Tensor | None) -> nn.Module:
                if name in blocks:  # the file's own int8 blocks, as they are
                    return GroupedInt8Linear(*blocks[name], bias)
                return Int8Linear.from_float(weight, bias)

            count = _swap_linears(model, int8)
            model.head = int8("embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight", head, None)
            if blocks:
                log.info("int8: %d matmuls serve the GGUF's Q8_0 blocks as they are, the others are quantized "
                         "per output channel", sum(isinstance(m, GroupedInt8Linear) for m in model.modules()))
        elif packing_applies(weight.device, weight.dtype) and weight.dtype == torch.bfloat16:
            count = _swap_linears(model, lambda _, w, b: BF16PackedLinear(w, b))
            model.head = BF16PackedLinear(head, None, fp32_out=True)
        elif packing_applies(weight.device, weight.dtype):
            count = _swap_linears(model, lambda _, w, b: DecodePackedLinear(w, b)) if decode_copies else 0
            model.head = PackedLinear(head, None)
        else:
            return 0
    if not model.tie_word_embeddings:
        del model.lm_head  # the prepared copy replaces it; a tied head's embedding stays for the lookup
    log.info("%s", mkl_on_amd.STATUS)  # the plain-weight calls' MKL path (prefill, one row): engine_core/mkl_on_amd.py
    how = {"int8": "int8, weight-only"}.get(quantization) or (
        ("bf16, Duet's AVX512_BF16 kernel" if cpu_bf16_linear.serves_here() else
         f"bf16, Duet's AMX kernel up to {PANEL_ROWS} rows, oneDNN-packed above" if cpu_bf16_linear.amx_path()
         else "bf16, oneDNN-packed")
        if weight.dtype == torch.bfloat16 else "oneDNN-packed (the layers for decode-sized calls)")
    log.info("CPU matmuls prepared at load: %d layers + the LM head, %s", count, how)
    return count + 1


def _swap_linears(model: nn.Module, make) -> int:
    """Every plain Linear but the LM head replaced by `make(its weight's parameter name, weight, bias)`."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name != "lm_head":
                setattr(parent, name, make(f"{parent_name}.{name}.weight".lstrip("."), child.weight, child.bias))
                count += 1
    return count
