"""torch.compile (inductor, CPU) of the decoder layers' elementwise work, once per worker at load.

Each DecoderLayer runs as two regions around attention (engine_core/model.py): `pre_attention` (residual add +
input RMSNorm, qkv matmul, split, rope) and `post_attention` (o_proj + residual add + RMSNorm, gate/up matmul,
SiLU-mul, down matmul). Both take only tensors, so one compiled graph serves every layer (the weights are graph
inputs, not constants) and inductor fuses each run of elementwise ops into one C++ loop: add+norm, split+rope,
SiLU-mul; the matmuls stay MKL calls. Attention (page indexing, the native decode kernel) stays eager between them.

The token dimension is dynamic (`dynamic=True`): torch specialises a size of 1, so the warm-up at load runs both
regions at 1 token and at 2 (the generic graph every larger batch takes), with and without the first layer's
`residual=None`: 6 graphs, compiled before the worker serves. Inductor's FX graph cache lives under Duet's cache
dir (`<cache>/inductor`, unless TORCHINDUCTOR_CACHE_DIR is set), so a restart re-traces but does not re-compile.

It applies on the CPU to single-rank models, unquantized or int8 on Duet's own kernel (`duet::int8_linear`, one
opaque op for any row count); a CUDA model keeps its Triton kernels; torch's int8 kernel, used on CPUs without
AVX512_BF16, branches on the row count, which would compile again mid-serving; tensor parallelism's all-reduce sits
inside post_attention. `--compile/--no-compile` (None: on unless DUET_COMPILE=0, which the tests set); with no
C++ compiler, or when compiling raises, the model stays eager and one line is logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch
from torch import nn

log = logging.getLogger(__name__)

_REGIONS = ("pre_attention", "post_attention")


def compile_requested(requested: bool | None, environ=os.environ) -> bool:
    """The `--compile/--no-compile` choice; None (the flag not given): on unless DUET_COMPILE=0."""
    if requested is not None:
        return requested
    return environ.get("DUET_COMPILE", "1").strip() != "0"


def cxx_compiler(environ=os.environ) -> str | None:
    """The C++ compiler inductor would build with (CXX, else g++ / c++ / clang++), or None."""
    for name in (environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


# read at import, before any model is built: building one (torch.device("meta")) already sets torch's default
_OPERATOR_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def inductor_cache_dir() -> str:
    """Where inductor's caches go (set here): TORCHINDUCTOR_CACHE_DIR when the operator set it, else
    `<Duet's cache dir>/inductor`."""
    if _OPERATOR_CACHE_DIR:
        path = _OPERATOR_CACHE_DIR
    else:
        from duet.cache_dir import cache_root

        path = str(cache_root() / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def compile_decoder(model: nn.Module, requested: bool | None = None, quantization: str = "none") -> bool:
    """Compile every layer's two regions and warm them up; True when the model now runs compiled."""
    weight = model.embed_tokens.weight
    if not compile_requested(requested) or weight.device.type != "cpu":
        return False  # off, or not the CPU: nothing to say
    if quantization != "none" and not native_int8_everywhere(model):
        log.info("--compile: skipped with --quantization %s on torch's int8 kernel (the decoder runs eager)",
                 quantization)
        return False
    if cxx_compiler() is None:
        log.warning("--compile: no C++ compiler found (g++, c++, clang++ or CXX); the decoder runs eager")
        return False
    cache = inductor_cache_dir()
    start, hits, misses = time.perf_counter(), _cache_count("hit"), _cache_count("miss")
    for layer in model.layers:
        for name in _REGIONS:
            setattr(layer, name, torch.compile(getattr(layer, name), dynamic=True))
    try:
        warm_up(model)
    except Exception as exc:  # noqa: BLE001 - dynamo, inductor or the C++ build: serve eager rather than not at all
        uncompile(model)
        log.warning("--compile: compiling failed (%s: %s); the decoder runs eager",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    log.info("--compile: decoder compiled in %.1f s (inductor cache %s: %d graphs hit, %d compiled)",
             time.perf_counter() - start, cache, _cache_count("hit") - hits, _cache_count("miss") - misses)
    return True


def native_int8_everywhere(model: nn.Module) -> bool:
    """Every int8 layer runs Duet's kernel (one op for any row count, kernels/cpu_int8_linear.py): torch's
    kernel branches on the row count, which would compile again mid-serving."""
    from engine_core.cpu_linear import GroupedInt8Linear, Int8Linear

    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, GroupedInt8Linear))]
    return bool(layers) and all(m.native for m in layers)


def _cache_count(kind: str) -> int:
    """Inductor's FX graph cache hits or misses so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"][f"fxgraph_cache_{kind}"]


def is_compiled(model: nn.Module) -> bool:
    return any(name in vars(layer) for layer in model.layers for name in _REGIONS)


def uncompile(model: nn.Module) -> None:
    """Back to the eager methods (the compiled ones are instance attributes over the class's)."""
    for layer in model.layers:
        for name in _REGIONS:
            vars(layer).pop(name, None)


@torch.inference_mode()
def warm_up(model: nn.Module) -> None:
    """Run both regions of the first two layers at 1 token and at 2, the first with residual=None: every graph
    serving will need, compiled now (all layers share them)."""
    weight = model.embed_tokens.weight
    c = model.config
    q_size = c.num_attention_heads * c.head_dim
    for tokens in (1, 2):
        hidden = torch.zeros(tokens, c.hidden_size, dtype=weight.dtype)
        positions = torch.arange(tokens)
        residual = None
        for layer in model.layers[:2]:
            *_, residual = layer.pre_attention(hidden, residual, positions, model.rope_cache)
            hidden, residual = layer.post_attention(torch.zeros(tokens, q_size, dtype=weight.dtype), residual)
