"""The GPU path, kept right by construction and checked on the CPU.

On a GPU, a seeded request whose torch.Generator sits on the CPU fails the whole step, and a tensor made
on the CPU inside the sampler does too. Both engines and the offline LLM take the device from one place
(the sampler's, which is the runner's, where the logits are). Here the engines run on `cpu:0`, a device
that compares unequal to a bare "cpu", so a generator made with a hard-coded or default device shows up;
and the sampler's tensor work runs on `meta` logits, where mixing in a CPU tensor raises.
"""

from __future__ import annotations

import torch

from engine_core import LLM
from engine_core.engine_core import EngineCore
from engine_core.forward_batch import SeqChunk, build_forward_batch
from engine_core.request import Request
from engine_core.sampler import Sampler, SampleRow, _filtered_probs
from engine_core.sampling_params import SamplingParams

DEVICE = torch.device("cpu", 0)


def record_generators(monkeypatch) -> list[torch.device]:
    made: list[torch.device] = []
    real = torch.Generator

    def generator(device="cpu"):
        made.append(torch.device(device))
        return real(device=device)

    monkeypatch.setattr(torch, "Generator", generator)
    return made


def seeded(n=1, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=n, ignore_eos=True, **kw)


def test_every_generator_of_both_engines_and_the_llm_is_on_the_logits_device(monkeypatch, hf_checkpoints):
    from duet.engine_config import EngineConfig, PagedConfig, PrefixConfig
    from engine_paged.worker import build_engine as build_paged
    from engine_prefix.worker import build_engine as build_prefix

    checkpoint = str(hf_checkpoints["llama"][0])
    made = record_generators(monkeypatch)
    engine = EngineConfig(model=checkpoint, device="cpu:0", kv_cache_tokens=512)
    for build, config, params in ((build_paged, PagedConfig(engine), seeded(n=3)),
                                  (build_prefix, PrefixConfig(engine), seeded())):
        parts = build(config)
        assert parts.scheduler.sampler.device == DEVICE
        core = EngineCore(parts.scheduler, parts.runner)
        core.add(Request("r", [5, 6, 7, 8], params))
        while core.has_unfinished():
            assert all(o.error is None for o in core.step().outputs)
    llm = LLM(checkpoint, device="cpu:0")
    llm.generate([[5, 6, 7]], seeded(n=2))
    assert len(made) >= 3 + 1 + 2 + 3  # samplers' own generators and one per seeded output
    assert set(made) == {DEVICE}, f"generators made on {set(made) - {DEVICE}}"


def test_the_sampler_refuses_a_generator_on_another_device():
    sampler = Sampler(8, (7,), "cpu")
    row = SampleRow(seeded(), [1], [], torch.Generator(device="cpu").manual_seed(1))
    sampler.sample(torch.zeros(1, 8), [row])  # same device: fine
    try:
        sampler.sample(torch.zeros(1, 8, device="meta"), [row])
    except AssertionError as exc:
        assert "Sampler.make_generator" in str(exc)
    else:
        raise AssertionError("a CPU generator for meta logits was accepted")


def test_sampler_tensors_follow_the_logits_device():
    """Every tensor the sampler makes is on logits.device: with meta logits a CPU tensor would raise."""
    sampler = Sampler(16, (15,), "cpu")
    rows = [SampleRow(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                                     min_tokens=4, temperature=0.7, top_k=3, top_p=0.8, min_p=0.05,
                                     stop_token_ids=(2,)), [1, 2, 3], [4, 4]),
            SampleRow(SamplingParams(temperature=0.0), [1], [])]
    logits = torch.zeros(2, 16, device="meta")
    shaped = sampler.penalized_logits(logits, rows)
    assert shaped.device.type == "meta"
    assert _filtered_probs(shaped, [r.params for r in rows]).device.type == "meta"


def test_the_forward_batch_carries_the_longest_chunk_as_a_host_int():
    chunks = [SeqChunk([1], 3, [0]), SeqChunk([1, 2, 3, 4, 5], 0, [1, 2]), SeqChunk([6, 7], 2, [3])]
    batch = build_forward_batch(chunks, 4, "cpu")
    assert batch.max_seqlen_q == 5 and isinstance(batch.max_seqlen_q, int)


def test_the_model_passes_max_seqlen_q_to_extend_attention(monkeypatch):
    """Without it the Triton launcher reads cu_seqlens back from the GPU in every layer of every prefill.
    (On the CPU the torch backend plans attention once per step instead; this is the Triton backend's branch.)"""
    from engine_core import attention_op, kernels

    seen = []

    def spy(*args, **kw):
        seen.append(kw.get("max_seqlen_q"))
        return torch.zeros(args[0].shape)

    monkeypatch.setattr(kernels, "extend_attention", spy)
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda q, *a, **kw: torch.zeros(q.shape))
    chunks = [SeqChunk([1], 3, [0]), SeqChunk([1, 2, 3, 4, 5], 0, [1, 2]), SeqChunk([6, 7], 2, [3])]
    batch = build_forward_batch(chunks, 4, "cpu")
    q = torch.zeros(batch.num_tokens, 2, 8)
    cache = torch.zeros(4, 4, 1, 8)
    out = attention_op.paged_attention(q, q[:, :1], q[:, :1], cache, cache, attention_op.AttentionStep(batch, None),
                                       1.0)
    assert out.shape == q.shape and seen == [5]
