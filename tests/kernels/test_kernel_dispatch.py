"""The package-level functions pick the implementation from the tensors' device and DUET_KERNELS."""

from __future__ import annotations

import pytest
import torch

import engine_core.kernels as K


def test_cpu_tensors_use_the_reference_by_default(monkeypatch):
    monkeypatch.delenv("DUET_KERNELS", raising=False)
    assert K.kernel_backend(torch.zeros(1)) == "torch"
    monkeypatch.setenv("DUET_KERNELS", "auto")
    assert K.kernel_backend(torch.zeros(1)) == "torch"


def test_setting_forces_either_backend(monkeypatch):
    x = torch.randn(3, 16)
    monkeypatch.setenv("DUET_KERNELS", "triton")
    assert K.kernel_backend(x) == "triton"
    via_triton = K.silu_and_mul(x)
    monkeypatch.setenv("DUET_KERNELS", "torch")
    assert K.kernel_backend(x) == "torch"
    torch.testing.assert_close(via_triton, K.silu_and_mul(x))


def test_unknown_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DUET_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DUET_KERNELS must be one of"):
        K.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)


def test_forced_triton_runs_every_op(monkeypatch, paged_kv):
    # the whole package API on the Triton path equals the reference path
    kv = paged_kv([5, 17], 16, 1, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    cu, prefix = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([2, 15], dtype=torch.int32)
    qx = torch.randn(5, 4, 64)
    cache = K.build_rope_cache(64, 32, 10000.0, None)
    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("DUET_KERNELS", backend)
        kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
        K.store_kv(torch.ones(2, 1, 64), torch.ones(2, 1, 64), kc, vc, torch.tensor([0, 33]))
        results[backend] = [
            kc, vc,
            K.paged_decode_attention(q, kc, vc, kv.block_tables, kv.lens, 0.125),
            K.extend_attention(qx, kc, vc, kv.block_tables, cu, prefix, 0.125),
            *K.apply_rope(qx, qx[:, :1], torch.arange(5), cache),
            *K.fused_add_rms_norm(qx[:, 0], qx[:, 1], torch.ones(64), 1e-6),
            K.rms_norm(qx, torch.ones(64), 1e-6),
        ]
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv("DUET_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        K.silu_and_mul(torch.randn(2, 8))
