"""torch.compile (inductor, CPU) of the decoder layers, once per worker at load.

Each DecoderLayer's forward is compiled: `pre_attention` (residual add + input RMSNorm, qkv matmul, split, rope),
the layer's attention op (`duet::layer_attention`, opaque to the compiler: engine_core/layer_attention.py) and
`post_attention` (o_proj + residual add + RMSNorm, gate/up matmul, SiLU-mul, down matmul). The layer takes only
tensors, so one compiled graph serves every layer (the weights are graph inputs, not constants), and inductor
fuses each run of elementwise ops into one C++ loop: add+norm, split+rope, SiLU-mul; the matmuls stay
`duet::cpu_linear` calls. One compiled call a layer: dynamo's guard checks and graph frame are paid 30 times a
step on SmolLM2, where two regions a layer with attention eager between them paid them 60 times
(docs/benchmarks.md has the figures). A graph of the whole stack would pay them once, but dynamo traces it
anew at every start, inductor's cache or not: 73 s against 7 s on the Zen 3 VM.

The token dimension is dynamic (`dynamic=True`): torch specialises a size of 1, so the warm-up at load runs a
forward of 1 token and one of 2 (the generic graph every larger batch takes), over a scratch KV pool of two
pages: 2 graphs, compiled before the worker serves. Inductor's FX graph cache lives under Duet's cache dir
(`<cache>/inductor`, unless TORCHINDUCTOR_CACHE_DIR is set), so a restart re-traces but does not re-compile.

It applies on the CPU, unquantized, single-rank models only (a CUDA model keeps its Triton kernels; int8's
Int8Linear branches on the row count, which would compile again mid-serving; tensor parallelism's all-reduce sits
inside post_attention). `--compile/--no-compile` (None: on unless DUET_COMPILE=0, which the tests set); with no
C++ compiler, or when compiling raises, the model stays eager and one line is logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch
from torch import nn

from engine_core.forward_batch import SeqChunk, build_forward_batch
from engine_core.kv_pool import KVPool

log = logging.getLogger(__name__)



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
    """Compile every layer's forward and warm them up; True when the model now runs compiled."""
    weight = model.embed_tokens.weight
    if not compile_requested(requested) or weight.device.type != "cpu":
        return False  # off, or not the CPU: nothing to say
    if quantization != "none":
        log.info("--compile: skipped with --quantization %s (the decoder runs eager)", quantization)
        return False
    if cxx_compiler() is None:
        log.warning("--compile: no C++ compiler found (g++, c++, clang++ or CXX); the decoder runs eager")
        return False
    cache = inductor_cache_dir()
    start, hits, misses = time.perf_counter(), _cache_count("hit"), _cache_count("miss")
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
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


def _cache_count(kind: str) -> int:
    """Inductor's FX graph cache hits or misses so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"][f"fxgraph_cache_{kind}"]


def is_compiled(model: nn.Module) -> bool:
    return any("forward" in vars(layer) for layer in model.layers)


def uncompile(model: nn.Module) -> None:
    """Back to the eager forward (the compiled one is an instance attribute over the class's)."""
    for layer in model.layers:
        vars(layer).pop("forward", None)


@torch.inference_mode()
def warm_up(model: nn.Module) -> None:
    """A forward of 1 token and one of 2 over a scratch pool of two pages: every graph serving will need,
    compiled now."""
    c = model.config
    page = 2
    pool = KVPool(c.num_hidden_layers, 2, page, c.num_key_value_heads, c.head_dim, model.embed_tokens.weight.dtype,
                  "cpu")
    for tokens in (1, 2):
        batch = build_forward_batch([SeqChunk([0] * tokens, 0, [0, 1])], page, "cpu")
        model(batch.input_ids, batch.positions, batch, pool.k_caches, pool.v_caches)
