"""engine_core/cpu_linear.py: the CPU matmuls prepared at load. The packed LM head gives F.linear's product for
any row count, and so do the layers' two layouts (a packed copy for decode-sized calls); int8 layers give the dequantized weights' product; a loaded model gets them on the CPU only,
and `--quantization int8` generates with every arch (the real model's quality: tests/realmodel/test_real_int8.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from duet.engine_config import ENGINE_DEFAULTS, QUANTIZATIONS
from engine_core import LLM, SamplingParams, cpu_linear
from engine_core.cpu_linear import (
    PACKED_ROWS,
    BF16PackedLinear,
    DecodePackedLinear,
    Int8Linear,
    PackedLinear,
    prepare_cpu_linears,
    quantize_per_channel,
)
from engine_core.kernels import cpu_bf16_linear, cpu_int8_grouped, cpu_int8_linear


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_weight_gives_f_linear_at_any_row_count(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer = PackedLinear(w, b)
    x = torch.randn(rows, 64, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 16, 32, 33, 300])
def test_decode_packed_layer_gives_f_linear_at_any_row_count(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer = DecodePackedLinear(w, b)
    assert layer.weight.t().is_contiguous()  # the plain layout is column-major, as F.linear runs it fastest
    x = torch.randn(rows, 64, generator=gen)
    for decode in (False, True):  # a decode step takes the packed copy at 2-32 rows
        with cpu_linear.decode_step(decode):
            torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer(x[None]), F.linear(x, w, b)[None], atol=1e-5, rtol=1e-5)


def test_prefill_calls_take_the_packed_copy_only_when_asked(monkeypatch):
    """By default a prefill-sized call runs F.linear on the column-major weight, bit for bit (the real-model
    tier's transformers parity); DUET_CPU_PACKED_PREFILL=1 sends it to the oneDNN copy, whose sums differ."""
    gen = torch.Generator().manual_seed(5)
    layer = DecodePackedLinear(torch.randn(96, 576, generator=gen), torch.randn(96, generator=gen))
    x = torch.randn(300, 576, generator=gen)
    plain = F.linear(x, layer.weight, layer.bias)
    packed = torch.ops.mkldnn._linear_pointwise(x, cpu_linear._packed_copy(layer.weight), layer.bias, "none", [], "")
    assert not torch.equal(plain, packed)  # else this test could not tell the two paths apart
    assert torch.equal(layer(x), plain)
    monkeypatch.setattr(cpu_linear, "_PACKED_PREFILL", True)
    assert torch.equal(layer(x), packed)
    assert torch.equal(layer(x[:1]), F.linear(x[:1], layer.weight, layer.bias))  # one row keeps MKL's GEMV


BF16_PACKING = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                  reason="oneDNN has no bf16 path on this CPU (needs AVX-512): bf16 keeps F.linear")


@BF16_PACKING
@pytest.mark.parametrize("cpu", ["avx512_bf16", "amx", "onednn"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_bf16_layer_keeps_the_copies_its_cpu_runs_and_gives_the_product(rows, cpu, monkeypatch):
    """Without AMX, Duet's kernel takes every call; on AMX its panels take the calls of up to PANEL_ROWS rows and
    oneDNN's copy the bigger ones; without AVX512_BF16 only oneDNN's copy is kept."""
    if cpu != "onednn" and cpu_bf16_linear.library() is None:
        pytest.skip("Duet's bf16 kernel needs a C compiler: oneDNN serves")
    monkeypatch.setattr(cpu_bf16_linear, "serves_here", lambda: cpu == "avx512_bf16")
    monkeypatch.setattr(cpu_bf16_linear, "amx_path", lambda: cpu == "amx")
    kernel_calls = []
    kernel = cpu_bf16_linear.bf16_linear_native
    monkeypatch.setattr(cpu_bf16_linear, "bf16_linear_native", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    layer = BF16PackedLinear(w, b)
    assert layer.weight.shape == w.shape and layer.weight.stride() == (0, 0)  # a stand-in: the values are packed
    assert (layer.panels is not None) == (cpu != "onednn")
    assert (cpu_linear._packed_copy(layer.weight) is not None) == (cpu != "avx512_bf16")  # by the stand-in's address
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    got = layer(x)
    want = F.linear(x.float(), w.float(), b.float())  # the exact product of the bf16 values
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert (got.float() - want).abs().max() <= 0.01 * want.abs().max()  # bf16's output rounding: ~3 digits
    # duet::cpu_linear's choice on AMX (without AMX the layer calls the kernel's own op, its only copy)
    assert len(kernel_calls) == (cpu == "amx" and rows <= cpu_linear.PANEL_ROWS)
    address = layer.weight.data_ptr()
    del layer
    assert address not in cpu_linear._PACKED_COPIES


@BF16_PACKING
def test_a_bf16_model_packs_every_matmul(hf_checkpoints):
    from duet.model_dir import read_model_dir
    from engine_core.model_runner import load_model

    md = read_model_dir(hf_checkpoints["llama"][0])
    model = load_model(md.config, md.weight_files, torch.device("cpu"), torch.bfloat16)
    kinds = {type(m) for m in model.modules()}
    assert BF16PackedLinear in kinds and torch.nn.Linear not in kinds and DecodePackedLinear not in kinds
    assert isinstance(model.head, BF16PackedLinear) and model.head.out_features == md.config.vocab_size
    assert model.head.fp32_out and not any(m.fp32_out for m in model.modules()
                                            if isinstance(m, BF16PackedLinear) and m is not model.head)


def test_a_packed_copy_lives_as_long_as_its_layer():
    """Compiled graphs find the packed copy by the weight's address; a freed layer must not leave its copy
    behind, where a later weight at the same address would pick it up."""
    layer = DecodePackedLinear(torch.randn(40, 16), None)
    assert cpu_linear._packed_copy(layer.weight) is not None and 16 in PACKED_ROWS and 1 not in PACKED_ROWS
    address = layer.weight.data_ptr()
    del layer
    assert address not in cpu_linear._PACKED_COPIES


@pytest.mark.parametrize("width", [64, 37])  # 37: not a multiple of the kernel's 16, padded
def test_int8_layer_is_the_product_with_its_dequantized_weights(width):
    gen = torch.Generator().manual_seed(width)
    w, b = torch.randn(48, width, generator=gen) * 0.05, torch.randn(48, generator=gen)
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (48,)
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7
    layer = Int8Linear(q, scale, b, native=False)  # torch's kernel
    x = torch.randn(2, 5, width, generator=gen)
    got = layer(x)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    want = F.linear(x, q.float() * scale[:, None], b)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # the kernel's bf16 activations: ~3 digits
    many = torch.randn(100, width, generator=gen)  # above the kernel's rows: the weight dequantized for the call
    torch.testing.assert_close(layer(many), F.linear(many, q.float() * scale[:, None], b), atol=1e-5, rtol=1e-5)
    native = Int8Linear(q, scale, b)
    if cpu_int8_linear.vector_path():  # the bf16-dot kernel, which the layer takes by default on this CPU
        assert native.native and native.group is None
        for rows in (x, many):  # bf16 activations at every row count (tests/kernels/test_cpu_int8_linear.py)
            want = F.linear(rows, q.float() * scale[:, None], b)
            assert (native(rows) - want).abs().max() <= 0.02 * want.abs().max()
    elif cpu_int8_grouped.vector_path():  # else the fp32 kernel, one scale group per row: fp32 activations
        assert native.native and native.group == width
        for rows in (x, many):
            torch.testing.assert_close(native(rows), F.linear(rows, q.float() * scale[:, None], b), atol=1e-5,
                                       rtol=1e-5)


def test_a_cpu_model_gets_a_packed_head_and_int8_swaps_every_plain_linear(hf_checkpoints):
    from duet.model_dir import read_model_dir
    from engine_core.model_runner import load_model

    md = read_model_dir(hf_checkpoints["llama"][0])
    fp32 = load_model(md.config, md.weight_files, torch.device("cpu"), torch.float32)
    assert isinstance(fp32.head, PackedLinear) and not hasattr(fp32, "lm_head")
    kinds = {type(m) for m in fp32.modules()}
    assert DecodePackedLinear in kinds and torch.nn.Linear not in kinds
    int8 = load_model(md.config, md.weight_files, torch.device("cpu"), torch.float32, quantization="int8")
    kinds = {type(m) for m in int8.modules()}
    assert Int8Linear in kinds and torch.nn.Linear not in kinds and isinstance(int8.head, Int8Linear)


def test_packing_off_keeps_f_linear_and_bf16_or_unknown_refuse(hf_checkpoints, monkeypatch):
    from duet.model_dir import read_model_dir
    from engine_core.model_runner import load_model

    monkeypatch.setenv("DUET_CPU_PACKED_WEIGHTS", "0")
    md = read_model_dir(hf_checkpoints["qwen2"][0])  # tied embeddings
    model = load_model(md.config, md.weight_files, torch.device("cpu"), torch.float32)
    assert model.head is None and type(model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert model.layers[0].mlp.down_proj.weight.t().is_contiguous()  # column-major
    with pytest.raises(ValueError, match="runs on the CPU from fp32 weights only"):
        prepare_cpu_linears(model.to(torch.bfloat16), "int8")
    with pytest.raises(ValueError, match="choose one of none, int8"):
        prepare_cpu_linears(model, "int4")
    assert QUANTIZATIONS == cpu_linear.QUANTIZATIONS


def test_int8_generates_on_every_arch_close_to_fp32(hf_checkpoints, arch):
    path, _ = hf_checkpoints[arch]
    prompt = list(range(5, 25))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [fp32] = LLM(path).generate([prompt], greedy)
    [int8] = LLM(path, quantization="int8").generate([prompt], greedy)
    assert len(int8.outputs[0].token_ids) == 8
    assert int8.outputs[0].token_ids[0] == fp32.outputs[0].token_ids[0]


def test_int8_does_not_combine_with_tensor_parallelism():
    with pytest.raises(ValueError, match="does not combine with --tensor-parallel-size"):
        dataclasses.replace(ENGINE_DEFAULTS, quantization="int8", tensor_parallel_size=2)
