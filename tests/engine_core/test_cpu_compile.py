"""`--compile` (engine_core.cpu_compile): a restart with a warm cache compiles nothing
(inductor's FX graph cache under Duet's cache dir), and a machine without a C++ compiler serves eager after one
line. Compiled parity with transformers (logits and greedy tokens, every arch) is in test_model_parity.py; the
rest of the tests run eager (tests/conftest.py sets DUET_COMPILE=0)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from duet.model_dir import read_model_dir
from engine_core import LLM, SamplingParams
from engine_core.cpu_compile import compile_decoder, compile_requested, is_compiled
from engine_core.forward_batch import SeqChunk
from engine_core.kernels import cpu_int8_grouped, cpu_int8_linear
from engine_core.kv_pool import KVPool, PageAllocator
from engine_core.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4  # tests/engine_core/test_model_parity.py's
PAGE = 4


_START = """
import json, sys
from duet.model_make import default_model_dir
from duet.model_dir import read_model_dir
from engine_core.cpu_compile import is_compiled
from engine_core.kv_pool import KVPool
from engine_core.model_runner import ModelRunner
from torch._dynamo.utils import counters
md = read_model_dir(default_model_dir())
c = md.config
runner = ModelRunner(md, KVPool(c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim, "float32", "cpu"),
                     "cpu", compile=True)
print(json.dumps({"compiled": is_compiled(runner.model), "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _start_worker_model(cache: Path) -> dict:
    env = {**os.environ, "DUET_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("DUET_COMPILE", None)
    out = subprocess.run([sys.executable, "-c", _START], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_restart_with_a_warm_cache_compiles_nothing(tmp_path):
    """Two processes load the default model compiled, one after the other, over one fresh Duet cache dir: the
    first compiles its 2 graphs (one token, and the generic one) into <cache>/inductor, the second finds every
    one of them there (the tiny model itself is made under the same cache dir by the first)."""
    first = _start_worker_model(tmp_path)
    assert first == {"compiled": True, "hit": 0, "miss": 2}
    assert any((tmp_path / "inductor").rglob("*.so")), "no compiled kernel in the cache dir"
    second = _start_worker_model(tmp_path)
    assert second == {"compiled": True, "hit": 2, "miss": 0}


def test_serving_after_the_warm_up_compiles_nothing_more(hf_checkpoints):
    """The warm-up at load compiles every graph serving takes: prefills, decodes of one and of many sequences and
    mixed steps of any size run the decoder's two graphs (a compile mid-serving would stall every request for
    seconds), and the step's page tables, which change shape every step, are no graph input."""
    from torch._dynamo.utils import counters

    path, hf = hf_checkpoints["llama"]
    md = read_model_dir(path)
    c = md.config
    pool = KVPool(c.num_hidden_layers, 32, PAGE, c.num_key_value_heads, c.head_dim, "float32", "cpu")
    runner = ModelRunner(md, pool, "cpu", compile=True)
    assert is_compiled(runner.model)
    compiled = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    alloc = PageAllocator(32)
    alloc.alloc(1)  # the warm-up's page
    a, b = alloc.alloc(5), alloc.alloc(5)
    ids = list(range(3, 20))
    steps = [[SeqChunk(ids, 0, a)], [SeqChunk([7], 17, a)], [SeqChunk([5, 6, 7], 0, b), SeqChunk([8], 18, a)],
             [SeqChunk([9], 19, a), SeqChunk([4], 3, b)]]
    logits = [runner.forward(chunks) for chunks in steps]
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == compiled
    with torch.inference_mode():  # and the last step's decodes are right: sequence b's 5th token over its pages
        want = hf(torch.tensor([[5, 6, 7, 4]])).logits[0, -1].float()
    torch.testing.assert_close(logits[-1][1], want, atol=ATOL, rtol=0)


def test_without_a_cxx_compiler_the_model_runs_eager_after_one_line(hf_checkpoints, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no g++, c++ or clang++ on it
    monkeypatch.delenv("CXX", raising=False)
    path, hf = hf_checkpoints["llama"]
    md = read_model_dir(path)
    c = md.config
    pool = KVPool(c.num_hidden_layers, 16, PAGE, c.num_key_value_heads, c.head_dim, "float32", "cpu")
    with caplog.at_level(logging.INFO, logger="engine_core.cpu_compile"):
        runner = ModelRunner(md, pool, "cpu", compile=True)
    assert not is_compiled(runner.model)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine_core.cpu_compile"]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "eager" in lines[0]
    ids = list(range(3, 15))
    got = runner.forward([SeqChunk(ids, 0, PageAllocator(16).alloc(3), tuple(range(len(ids))))])
    with torch.inference_mode():
        torch.testing.assert_close(got, hf(torch.tensor([ids])).logits[0].float(), atol=ATOL, rtol=0)


def test_compile_is_on_unless_the_flag_or_duet_compile_says_off():
    assert compile_requested(None, {}) is True
    assert compile_requested(None, {"DUET_COMPILE": "0"}) is False
    assert compile_requested(True, {"DUET_COMPILE": "0"}) is True
    assert compile_requested(False, {}) is False


def test_int8_compiles_on_duets_kernel_only_and_the_flag_off_leaves_the_decoder_eager(hf_checkpoints, monkeypatch):
    path, _ = hf_checkpoints["llama"]
    assert not is_compiled(LLM(path, compile=False).runner.model)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # Duet's int8 kernels (bf16 dots, or fp32 FMAs on AVX2) are one opaque op for any row count: they compile
    if cpu_int8_linear.vector_path() or cpu_int8_grouped.vector_path():
        compiled = LLM(path, quantization="int8", compile=True)
        assert is_compiled(compiled.runner.model)
        eager = LLM(path, quantization="int8", compile=False)
        assert ([o.outputs[0].token_ids for o in compiled.generate(prompts, greedy)]
                == [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)])
    # torch's int8 kernel branches on the row count: eager
    monkeypatch.setenv("DUET_NATIVE_CPU_INT8", "0")
    cpu_int8_linear.library.cache_clear()
    cpu_int8_grouped.library.cache_clear()
    try:
        assert not is_compiled(LLM(path, quantization="int8", compile=True).runner.model)
    finally:
        monkeypatch.undo()
        cpu_int8_linear.library.cache_clear()
        cpu_int8_grouped.library.cache_clear()
    # compile_decoder on a model that is not on the CPU does nothing (the GPU path keeps its Triton kernels)
    with torch.device("meta"):
        from engine_core.model import DecoderModel

        meta = DecoderModel(read_model_dir(path).config)
    assert compile_decoder(meta, None, True) is False and not is_compiled(meta)



def test_a_bf16_model_compiles_around_its_matmul_op_and_keeps_the_eager_logits(hf_checkpoints):
    """bf16 layers call one opaque op for any row count (Duet's kernel's panels, or oneDNN's copy found by the
    stand-in weight's address): the compiled decoder runs a prefill and a decode step on them and its logits are
    the eager model's up to bf16 rounding (inductor rounds fused elementwise work once, eager after every op: on
    the tiny random model, whose logits lie close together, that alone changes greedy tokens)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        import pytest

        pytest.skip("oneDNN has no bf16 path on this CPU (needs AVX-512): a bf16 model keeps F.linear")
    path, _ = hf_checkpoints["llama"]
    md = read_model_dir(path)
    c = md.config
    logits = []
    for compile in (True, False):
        pool = KVPool(c.num_hidden_layers, 16, PAGE, c.num_key_value_heads, c.head_dim, "bfloat16", "cpu")
        runner = ModelRunner(md, pool, "cpu", "bfloat16", compile=compile)
        assert is_compiled(runner.model) == compile
        pages = PageAllocator(16).alloc(4)
        ids = list(range(3, 15))
        prefill = runner.forward([SeqChunk(ids, 0, pages, tuple(range(len(ids))))])
        decode = runner.forward([SeqChunk([7], len(ids), pages)])  # one token: the 1-token graph
        logits.append(torch.cat([prefill, decode]).float())
    compiled, eager = logits
    scale = eager.abs().max().item()
    # measured 4.5% of the largest logit apart (bf16's rounding, compounded over the layers of a random model);
    # a wrong weight or a graph reused with another layer's shapes moves them by their whole scale
    assert (compiled - eager).abs().max().item() <= 0.1 * scale, "compiled bf16 logits left the eager ones"
