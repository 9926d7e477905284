"""torch.compile (inductor, CPU) of the whole decoder as one graph, once per worker at load.

`DecoderModel.decoder` (engine_core/model.py) runs every layer and the final norm; it takes only tensors, and
attention inside it is one opaque op (`duet::paged_attention`, engine_core/attention_op.py) that finds the step's
page tables itself. So one graph covers the decoder, entered once a step: inductor fuses each run of elementwise
ops into one C++ loop (add+norm, split+rope, SiLU-mul) around the matmul and attention ops. The layer's forward
is a nested compile region (`torch.compiler.nested_compile_region`): traced and compiled once, called per layer.
Compiled per region instead (two around each layer's attention, as before), a 16-sequence decode step entered
dynamo 60 times and ran attention's Python between them.

Shapes: the graph is specialised to the first call's and made dynamic in the token dimension by the second
(torch's automatic dynamic shapes), so the warm-up at load runs one token and then two, on the pool's own caches
(their shapes are the graph's too): 2 graphs, compiled before the worker serves. Inductor's FX graph cache lives
under Duet's cache dir (`<cache>/inductor`, unless TORCHINDUCTOR_CACHE_DIR is set), so a restart re-traces but
does not re-compile. (Inductor's C++ wrapper would take the Python out of the graph's calls too, but it cannot
call a nested region, and without regions the 30 layers' kernels compile one by one: minutes at load.)

It applies on the CPU to single-rank models, unquantized or int8 on Duet's own kernel (`duet::int8_linear`, one
opaque op for any row count); a CUDA model keeps its Triton kernels; torch's int8 kernel, used on CPUs without
AVX512_BF16, branches on the row count, which would compile again mid-serving; tensor parallelism's all-reduce sits
inside the layers. `--compile/--no-compile` (None: on unless DUET_COMPILE=0, which the tests set); with no
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


def compile_decoder(model: nn.Module, kv_pool, requested: bool | None = None, quantization: str = "none") -> bool:
    """Compile the decoder and warm it up on `kv_pool`'s caches; True when the model now runs compiled."""
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
    model.decoder = torch.compile(model.decoder)
    try:
        warm_up(model, kv_pool)
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
    return "decoder" in vars(model)


def uncompile(model: nn.Module) -> None:
    """Back to the eager method (the compiled one is an instance attribute over the class's)."""
    vars(model).pop("decoder", None)


@torch.inference_mode()
def warm_up(model: nn.Module, kv_pool) -> None:
    """Run the model on one token and on two: both graphs serving will need, compiled now. The tokens' K/V go to
    the pool's first page, which no sequence holds yet (whoever takes it overwrites them before reading)."""
    from engine_core.forward_batch import SeqChunk, build_forward_batch

    for tokens in (1, 2):
        batch = build_forward_batch([SeqChunk([0] * tokens, 0, [0])], kv_pool.page_size, kv_pool.device)
        model(batch.input_ids, batch.positions, batch, kv_pool.k_caches, kv_pool.v_caches)
