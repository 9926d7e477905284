"""The batched sampler: seeds, greedy equivalences, penalties, filters, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine_core.sampler import Sampler, SampleRow, greedy_ids, make_generator
from engine_core.sampling_params import SamplingParams

V = 32
EOS = 2


def _logits(rows, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def _row(params, prompt=(5, 6), output=(), generator=None):
    return SampleRow(params, list(prompt), list(output), generator)


def test_seeded_row_gives_the_same_tokens_whatever_else_is_in_the_batch():
    sampler = Sampler(V, [EOS], seed=0)
    target = SamplingParams(temperature=1.0, seed=7)
    steps = [_logits(1, seed=s)[0] for s in range(30)]

    def run(batch_before, batch_after, other_params):
        gen = make_generator(7, "cpu")
        others = [make_generator(p.seed, "cpu") for p in other_params]
        tokens = []
        for step_logits in steps:
            noise_rows = [_logits(1, seed=100 + len(tokens) + k)[0] for k in range(batch_before + batch_after)]
            logits = torch.stack(noise_rows[:batch_before] + [step_logits] + noise_rows[batch_before:])
            rows = [_row(p, generator=g) for p, g in zip(other_params, others)]
            rows.insert(batch_before, _row(target, generator=gen))
            tokens.append(sampler.sample(logits, rows).token_ids[batch_before])
        return tokens

    alone = run(0, 0, [])
    crowded = run(2, 1, [SamplingParams(temperature=0.7), SamplingParams(seed=3), SamplingParams(temperature=0.0)])
    assert alone == crowded
    assert len(set(alone)) > 3  # it is really sampling, not collapsing to argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_takes_the_first_of_tied_largest_logits(dtype, threads):
    # rows of a real vocabulary's width, so torch splits the reduction across threads; each row's maximum is
    # tied at several places, the first one anywhere from the start to the last chunk
    vocab, firsts = 49152, [0, 1, 4095, 4096, 24575, 30001, 49150]
    logits = torch.randn(len(firsts) + 1, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    for row, first in enumerate(firsts):
        for col in (first, first + 1, vocab - 1, (first + vocab) // 2):
            logits[row, col] = 10.0
    logits[-1] = 1.0  # all tied: the first column
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids = greedy_ids(logits).tolist()
    finally:
        torch.set_num_threads(before)
    assert ids == [*firsts, 0]


def test_top_k_1_and_temperature_0_are_greedy():
    sampler = Sampler(V, [EOS])
    logits = _logits(8, seed=1)
    expected = logits.argmax(dim=-1).tolist()
    rows_k1 = [_row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(8)]
    rows_t0 = [_row(SamplingParams(temperature=0.0)) for _ in range(8)]
    assert sampler.sample(logits, rows_k1).token_ids == expected
    assert sampler.sample(logits, rows_t0).token_ids == expected


def test_penalties_match_a_direct_computation():
    sampler = Sampler(V, [EOS])
    logits = _logits(1, seed=2)[0]
    prompt, output = [3, 4, 4], [4, 9, 9, 9, 10]
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    got = sampler.penalized_logits(logits[None], [_row(p, prompt, output)])[0]

    expected = logits.clone()
    for token in set(prompt) | set(output):  # repetition: prompt and output, sign-aware
        x = expected[token].item()
        expected[token] = x / 1.3 if x > 0 else x * 1.3
    for token in set(output):  # frequency (per occurrence) and presence (once): output only
        expected[token] -= 0.4 * output.count(token) + 0.25
    torch.testing.assert_close(got, expected)


def test_penalties_steer_greedy_choice_away_from_repeated_tokens():
    sampler = Sampler(V, [EOS])
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8] = 3.0, 2.5
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    history = [7, 7]
    assert sampler.sample(logits, [_row(plain, output=history)]).token_ids == [7]
    assert sampler.sample(logits, [_row(penalized, output=history)]).token_ids == [8]


def _frequencies(params, probs, draws=4000):
    sampler = Sampler(len(probs), [EOS], seed=1)
    logits = torch.tensor(probs).log().expand(draws, -1)
    tokens = sampler.sample(logits, [_row(params, prompt=()) for _ in range(draws)]).token_ids
    return [tokens.count(t) / draws for t in range(len(probs))]


PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=3), [0, 1, 2]),
    (SamplingParams(top_p=0.7), [0, 1, 2]),  # 0.4 + 0.25 < 0.7, so the third token is still needed
    (SamplingParams(top_p=0.6), [0, 1]),  # 0.4 + 0.25 already covers 0.6
    (SamplingParams(min_p=0.3), [0, 1, 2]),  # keeps p >= 0.3 * 0.4 = 0.12
    (SamplingParams(), [0, 1, 2, 3, 4, 5]),
])
def test_filters_keep_exactly_the_specified_tokens_renormalized(params, kept):
    freq = _frequencies(params, PROBS)
    total = sum(PROBS[t] for t in kept)
    for t, f in enumerate(freq):
        expected = PROBS[t] / total if t in kept else 0.0
        assert f == pytest.approx(expected, abs=0.035), (t, freq)


def test_temperature_sharpens_and_flattens():
    cold = _frequencies(SamplingParams(temperature=0.5), PROBS)
    hot = _frequencies(SamplingParams(temperature=2.0), PROBS)
    weights = [p ** 2 for p in PROBS]
    assert cold[0] == pytest.approx(weights[0] / sum(weights), abs=0.035)
    assert hot[0] < PROBS[0] < cold[0]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    sampler = Sampler(V, [EOS])
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 11], logits[0, 5] = 10.0, 9.0, 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(11,))
    for n in range(3):
        assert sampler.sample(logits, [_row(p, output=[5] * n)]).token_ids == [5]
    assert sampler.sample(logits, [_row(p, output=[5] * 3)]).token_ids == [EOS]
    # ignore_eos: EOS is an ordinary token, but stop ids stay blocked under min_tokens
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(11,), ignore_eos=True)
    assert sampler.sample(logits, [_row(p, output=[])]).token_ids == [EOS]


def test_logprobs_are_log_softmax_of_the_raw_logits_with_top_alternatives():
    sampler = Sampler(V, [EOS])
    logits = _logits(3, seed=4)
    rows = [_row(SamplingParams(temperature=0.8, logprobs=5, repetition_penalty=1.5, seed=1), output=[1, 2]),
            _row(SamplingParams(temperature=0.0)),
            _row(SamplingParams(temperature=0.0, logprobs=0))]
    rows[0].generator = make_generator(1, "cpu")
    out = sampler.sample(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, ref[0, first.token_id].item(), abs_tol=1e-5)
    values, ids = ref[0].topk(5)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == () and math.isclose(out.logprobs[2].logprob, ref[2].max().item(), abs_tol=1e-5)


def test_the_callers_logits_are_never_changed():
    # the plain batch skips the defensive copy; a batch with a min_tokens mask or a penalty still makes one
    sampler = Sampler(V, [EOS], seed=0)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                   SamplingParams(temperature=0.0, min_tokens=3), SamplingParams(presence_penalty=1.0)):
        logits = _logits(4, seed=1)
        logits[:, EOS] = 100.0  # min_tokens must mask it in the sampler's copy only
        before = logits.clone()
        out = sampler.sample(logits, [_row(params, output=(7,)) for _ in range(4)])
        assert torch.equal(logits, before)
        assert (EOS in out.token_ids) == (params.min_tokens == 0)


def test_logit_bias_forces_and_bans_tokens_per_row_and_leaves_logprobs_unbiased():
    sampler = Sampler(V, [EOS], seed=0)
    logits = _logits(3, seed=4)
    top = logits.argmax(dim=-1).tolist()
    forced = SamplingParams(temperature=0.0, logit_bias=((11, 100.0),), logprobs=0)
    banned = SamplingParams(temperature=0.0, logit_bias=((top[1], -100.0),))
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias=((top[2], -100.0), (9, 100.0)))
    out = sampler.sample(logits, [_row(forced), _row(banned), _row(sampled, generator=make_generator(3, "cpu"))])
    assert out.token_ids[0] == 11
    assert out.token_ids[1] != top[1] and out.token_ids[1] == logits[1].topk(2).indices[1].item()
    assert out.token_ids[2] == 9
    raw = torch.log_softmax(logits[0], dim=-1)[11].item()
    assert out.logprobs[0].logprob == pytest.approx(raw)  # the model's own logprob, not the biased one
    assert torch.equal(logits, _logits(3, seed=4))  # the caller's tensor is untouched


def test_logit_bias_keys_and_values_are_validated():
    from engine_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="vocabulary"):
        SamplingParams(logit_bias=((V, 1.0),)).validate(V)
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((1, 101.0),)).validate(V)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate(V)
