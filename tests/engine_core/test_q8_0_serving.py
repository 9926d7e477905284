"""A GGUF Q8_0 file served as int8 (`--quantization int8`): every matmul, the LM head included, runs on the file's
own int8 blocks and scales (engine_core.cpu_linear.GroupedInt8Linear), never re-quantized, and computes what fp32
serving of the same file computes (its weights are those blocks dequantized), so greedy tokens are the same, eager,
compiled, and where each call dequantizes for itself (DUET_NATIVE_CPU_INT8=0)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from duet.gguf import convert_gguf
from duet.model_dir import read_model_dir
from engine_core import LLM, SamplingParams
from engine_core.cpu_compile import is_compiled
from engine_core.cpu_linear import GroupedInt8Linear, Int8Linear
from engine_core.kernels import cpu_int8_grouped
from engine_core.model_runner import load_model
from tests.support.gguf_files import write_gguf

PROMPTS = [[5, 9, 2, 7, 1, 3, 11, 40], [4, 4, 8]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def q8_0_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q8_0")
    write_gguf(tmp / "tiny-q8_0.gguf", quant=GGMLQuantizationType.Q8_0)
    return convert_gguf(tmp / "tiny-q8_0.gguf", tmp / "hf")


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_every_matmul_runs_on_the_files_blocks_and_equals_the_dequantized_fp32_one(q8_0_dir):
    md = read_model_dir(q8_0_dir)
    cpu = torch.device("cpu")
    int8 = load_model(md.config, md.weight_files, cpu, torch.float32, quantization="int8", q8_0_file=md.q8_0_file)
    fp32 = load_model(md.config, md.weight_files, cpu, torch.float32)
    layers = dict(int8.named_modules())
    grouped = {name for name, m in layers.items() if isinstance(m, GroupedInt8Linear)}
    assert not any(isinstance(m, Int8Linear) for m in int8.modules())  # nothing re-quantized per channel
    assert isinstance(int8.head, GroupedInt8Linear) and int8.head.group == 32
    # q/k/v and gate/up are stacked into the fused layers in the checkpoint's order, q/k rows un-interleaved
    gen = torch.Generator().manual_seed(0)
    for name in grouped - {"head"}:
        module, weight = layers[name], dict(fp32.named_modules())[name].weight
        x = torch.randn(5, module.in_features, generator=gen)
        want = torch.nn.functional.linear(x.double(), weight.double())
        assert ((module(x).double() - want).abs().max() / want.abs().max()).item() < 1e-5, name
    assert len(grouped - {"head"}) == 4 * md.config.num_hidden_layers  # qkv, o, gate_up, down


def test_greedy_tokens_match_fp32_serving_of_the_same_file(q8_0_dir, monkeypatch):
    want = _tokens(LLM(str(q8_0_dir)))
    assert _tokens(LLM(str(q8_0_dir), quantization="int8")) == want
    if cpu_int8_grouped.library() is not None:  # one opaque op for any row count: the decoder compiles
        compiled = LLM(str(q8_0_dir), quantization="int8", compile=True)
        assert is_compiled(compiled.runner.model)
        assert _tokens(compiled) == want
    monkeypatch.setenv("DUET_NATIVE_CPU_INT8", "0")  # no kernel: each call dequantizes its weight
    cpu_int8_grouped.library.cache_clear()
    try:
        llm = LLM(str(q8_0_dir), quantization="int8")
        assert not llm.runner.model.head.native
        assert _tokens(llm) == want
    finally:
        monkeypatch.undo()
        cpu_int8_grouped.library.cache_clear()
