"""RMSNorm, RoPE, SiLU-and-mul and store-KV: Triton kernels (interpreter) against the torch references, and
the references against plain math / Hugging Face."""

from __future__ import annotations

from importlib import import_module

import pytest
import torch

norm = import_module("engine_core.kernels.rms_norm")
rope = import_module("engine_core.kernels.rope")
act = import_module("engine_core.kernels.activation")
store = import_module("engine_core.kernels.store_kv")

F32, F16 = torch.float32, torch.float16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])
def test_fused_add_rms_norm_matches_reference(tol, dtype, with_residual, hidden):
    x, w = torch.randn(5, hidden).to(dtype), torch.randn(hidden).to(dtype)
    residual = torch.randn(5, hidden).to(dtype) if with_residual else None
    out, new_res = norm.fused_add_rms_norm_triton(x, residual, w, 1e-6)
    ref_out, ref_res = norm.fused_add_rms_norm_ref(x, residual, w, 1e-6)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=tol(dtype)[0], rtol=tol(dtype)[1])


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_over_heads_matches_reference(tol, dtype, head_dim):
    # qwen3's q/k norm: [tokens, heads, head_dim], normalized per head
    x, w = torch.randn(3, 4, head_dim).to(dtype), torch.randn(head_dim).to(dtype)
    torch.testing.assert_close(norm.rms_norm_triton(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6),
                               atol=tol(dtype)[0], rtol=tol(dtype)[1])


def test_rms_norm_reference_is_the_formula():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    out, new_res = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
    s = x + r
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("head_dim,ratio", [(64, 1), (128, 4), (64, 8)])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["standard", "llama3"])
def test_rope_kernel_matches_reference(tol, dtype, head_dim, ratio, scaling):
    cache = rope.build_rope_cache(head_dim, 256, 500000.0, scaling)
    q = torch.randn(6, 2 * ratio, head_dim).to(dtype)
    k = torch.randn(6, 2, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 15, 16, 200, 255])
    q_out, k_out = rope.apply_rope_triton(q, k, positions, cache)
    q_ref, k_ref = rope.apply_rope_ref(q, k, positions, cache)
    atol, rtol = tol(dtype)
    torch.testing.assert_close(q_out, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out, k_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["standard", "llama3"])
def test_rope_reference_equals_transformers_llama(scaling):
    # the reference is what CPU parity with transformers rests on: it must be bit-identical in fp32
    transformers = pytest.importorskip("transformers", reason="transformers (a dev dependency) is not installed")
    from transformers.models.llama import modeling_llama as hf

    kwargs = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "rope_theta": 500000.0,
              "max_position_embeddings": 512}
    if scaling is not None:
        kwargs["rope_scaling"] = dict(scaling)
    hf_rope = hf.LlamaRotaryEmbedding(transformers.LlamaConfig(**kwargs))
    torch.testing.assert_close(rope.rope_inv_freq(64, 500000.0, scaling), hf_rope.inv_freq, atol=0, rtol=0)

    cache = rope.build_rope_cache(64, 512, 500000.0, scaling)
    positions = torch.tensor([0, 3, 63, 64, 300, 511])
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    cos, sin = hf_rope(q, positions[None])
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = rope.apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), atol=0, rtol=0)


def test_rope_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        rope.build_rope_cache(64, 8, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope.build_rope_cache(64, 8, 10000.0, {"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("inter", [48, 1100])
def test_silu_and_mul_matches_reference(tol, dtype, inter):
    x = torch.randn(3, 2 * inter).to(dtype)
    out = act.silu_and_mul_triton(x)
    assert out.shape == (3, inter)
    torch.testing.assert_close(out, act.silu_and_mul_ref(x), atol=tol(dtype)[0], rtol=tol(dtype)[1])
    gate, up = x.float()[:, :inter], x.float()[:, inter:]
    torch.testing.assert_close(act.silu_and_mul_ref(x).float(), gate * torch.sigmoid(gate) * up,
                               atol=tol(dtype)[0], rtol=tol(dtype)[1])


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("page_size,heads,head_dim", [(1, 2, 64), (16, 1, 128), (16, 8, 64)])
def test_store_kv_matches_reference(dtype, page_size, heads, head_dim):
    num_pages, tokens = 6, 5
    caches = [torch.randn(num_pages, page_size, heads, head_dim).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    slots = torch.randperm(num_pages * page_size)[:tokens]
    k, v = torch.randn(tokens, heads, head_dim).to(dtype), torch.randn(tokens, heads, head_dim).to(dtype)
    store.store_kv_triton(k, v, *caches, slots)
    store.store_kv_ref(k, v, *ref_caches, slots)
    torch.testing.assert_close(caches[0], ref_caches[0], atol=0, rtol=0)
    torch.testing.assert_close(caches[1], ref_caches[1], atol=0, rtol=0)
    page, offset = divmod(int(slots[0]), page_size)
    torch.testing.assert_close(caches[0][page, offset], k[0], atol=0, rtol=0)


def test_elementwise_launchers_reject_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm_triton(torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        act.silu_and_mul_triton(torch.randn(2, 7))
    with pytest.raises(ValueError, match="slot_mapping"):
        store.store_kv_triton(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.zeros(2, 4, 1, 8),
                              torch.zeros(2, 4, 1, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope.apply_rope_triton(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.tensor([0, 1]), torch.randn(4, 6))
