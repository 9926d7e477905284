"""Paged decode and extend attention: the Triton kernels (interpreter) against the torch references, and the
references against attention written out token by token."""

from __future__ import annotations

from importlib import import_module

import pytest
import torch

decode = import_module("engine_core.kernels.decode_attention")
extend = import_module("engine_core.kernels.extend_attention")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (page_size, num_kv_heads, q/kv ratio, head_dim, dtype, context lengths): every listed value appears —
# length 1, exactly one page, across page boundaries, ragged batches — without the full cross product
DECODE_CASES = [
    (16, 2, 1, 64, F32, [1]),
    (16, 1, 4, 128, F16, [16]),
    (16, 1, 8, 64, F32, [1, 16, 17, 40]),
    (16, 2, 1, 128, F16, [33, 5]),
    (1, 2, 4, 64, F32, [1]),
    (1, 1, 8, 128, F16, [1, 2, 9]),
    (1, 2, 1, 64, F16, [7, 3]),
    (16, 1, 4, 64, BF16, [20, 2]),
]


def _ids(cases):
    return [f"page{c[0]}-kv{c[1]}x{c[2]}-d{c[3]}-{str(c[4])[6:]}-len{'_'.join(map(str, c[5]))}" for c in cases]


def _decode_inputs(paged_kv, page_size, hk, ratio, d, dtype, lens):
    kv = paged_kv(lens, page_size, hk, d, dtype)
    q = torch.randn(len(lens), hk * ratio, d).to(dtype)
    return q, kv


@pytest.mark.parametrize("page_size,hk,ratio,d,dtype,lens", DECODE_CASES, ids=_ids(DECODE_CASES))
def test_decode_kernel_matches_reference(paged_kv, tol, page_size, hk, ratio, d, dtype, lens):
    q, kv = _decode_inputs(paged_kv, page_size, hk, ratio, d, dtype, lens)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, d**-0.5)
    out = decode.paged_decode_attention_triton(*args)
    ref = decode.paged_decode_attention_ref(*args)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = tol(dtype)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_split_kv_reduce_matches_reference(paged_kv, tol, num_splits):
    # more splits than a short sequence has tokens: empty splits must weigh nothing
    q, kv = _decode_inputs(paged_kv, 1, 1, 4, 64, F32, [45, 2, 1])
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.125)
    out = decode.paged_decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out, decode.paged_decode_attention_ref(*args), atol=2e-5, rtol=2e-5)


# (page_size, num_kv_heads, ratio, head_dim, dtype, prefix lengths, new lengths)
EXTEND_CASES = [
    (16, 2, 1, 64, F32, [0], [1]),
    (16, 1, 4, 128, F16, [0], [16]),
    (16, 1, 8, 64, F32, [0, 16, 5, 3], [1, 20, 12, 0]),
    (16, 2, 1, 128, F16, [17], [18]),
    (1, 2, 4, 64, F32, [2], [1]),
    (1, 1, 8, 128, F16, [0, 3], [9, 4]),
    (16, 1, 4, 64, BF16, [7], [10]),
]


@pytest.mark.parametrize(
    "page_size,hk,ratio,d,dtype,prefix,new",
    EXTEND_CASES,
    ids=[f"{i}-" + s for i, s in enumerate(_ids([c[:5] + (c[6],) for c in EXTEND_CASES]))],
)
def test_extend_kernel_matches_reference(paged_kv, tol, page_size, hk, ratio, d, dtype, prefix, new):
    kv = paged_kv([p + n for p, n in zip(prefix, new)], page_size, hk, d, dtype)
    q = torch.randn(sum(new), hk * ratio, d).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, torch.tensor(prefix, dtype=torch.int32), d**-0.5)
    out = extend.extend_attention_triton(*args)
    ref = extend.extend_attention_ref(*args)
    atol, rtol = tol(dtype)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def _naive(q_vec, keys, values, scale):
    # one query head against its visible keys [L, D]
    return torch.softmax(keys @ q_vec * scale, dim=0) @ values


def _seq_kv(kv, b, length):
    ps = kv.k_cache.shape[1]
    rows = [(int(kv.block_tables[b, j // ps]), j % ps) for j in range(length)]
    return torch.stack([kv.k_cache[p, o] for p, o in rows]), torch.stack([kv.v_cache[p, o] for p, o in rows])


# the second case has contexts longer than one of the reference's blocks (64 positions): the softmax must
# span the blocks
@pytest.mark.parametrize("lens, page_size", [([1, 4, 9, 17], 4), ([1, 64, 65, 200], 16)])
def test_decode_reference_is_plain_attention(paged_kv, lens, page_size):
    ratio = 4
    q, kv = _decode_inputs(paged_kv, page_size, 2, ratio, 16, F32, lens)
    out = decode.paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 0.3)
    for b, n in enumerate(lens):
        keys, values = _seq_kv(kv, b, n)
        for h in range(q.shape[1]):
            want = _naive(q[b, h], keys[:, h // ratio], values[:, h // ratio], 0.3)
            torch.testing.assert_close(out[b, h], want, atol=1e-5, rtol=1e-5)


def test_extend_reference_is_causal_attention_over_prefix(paged_kv):
    prefix, new, ratio = [0, 3, 8], [4, 1, 6], 2
    kv = paged_kv([p + n for p, n in zip(prefix, new)], 4, 2, 16, F32)
    q = torch.randn(sum(new), 2 * ratio, 16)
    cu = [0, 4, 5, 11]
    out = extend.extend_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(cu, dtype=torch.int32),
        torch.tensor(prefix, dtype=torch.int32), 0.2,
    )
    for b in range(3):
        keys, values = _seq_kv(kv, b, prefix[b] + new[b])
        for j in range(new[b]):
            visible = prefix[b] + j + 1
            for h in range(q.shape[1]):
                want = _naive(q[cu[b] + j, h], keys[:visible, h // ratio], values[:visible, h // ratio], 0.2)
                torch.testing.assert_close(out[cu[b] + j, h], want, atol=1e-5, rtol=1e-5)


def test_attention_launchers_reject_bad_shapes(paged_kv):
    q, kv = _decode_inputs(paged_kv, 16, 2, 1, 64, F32, [3])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode.paged_decode_attention_triton(q[:, :1].repeat(1, 3, 1), kv.k_cache, kv.v_cache, kv.block_tables,
                                             kv.lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode.paged_decode_attention_triton(q[..., :32], kv.k_cache, kv.v_cache, kv.block_tables, kv.lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        decode.paged_decode_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.lens.float(), 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        extend.extend_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                       torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 1.0)
