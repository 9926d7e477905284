"""The offline LLM API: stopping rules, n, seeds across batches, logprobs, fixed KV budgets, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duet.model_dir import read_model_dir
from engine_core import LLM, CapacityError, InvalidRequestError, SamplingParams

PROMPT = [5, 9, 44, 17, 3, 80, 120]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return hf_checkpoints["llama"][0]


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama, page_size=4)


@pytest.fixture(scope="module")
def greedy_tokens(llm):
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_single_prompt_and_single_params_are_accepted(llm, greedy_tokens):
    [out] = llm.generate(PROMPT, GREEDY)
    assert out.prompt_token_ids == PROMPT and out.outputs[0].token_ids == greedy_tokens


def test_stop_token_id_ends_the_output_with_reason_stop(llm, greedy_tokens):
    stop = greedy_tokens[4]
    first = greedy_tokens.index(stop)
    out = llm.generate([PROMPT], dataclasses.replace(GREEDY, stop_token_ids=(stop,)))[0].outputs[0]
    assert out.token_ids == greedy_tokens[:first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignore_eos_and_min_tokens_delays_it(llama, greedy_tokens):
    md = read_model_dir(llama)
    eos = greedy_tokens[2]
    first = greedy_tokens.index(eos)
    llm = LLM(dataclasses.replace(md, config=dataclasses.replace(md.config, eos_token_ids=(eos,))))
    stops = llm.generate([PROMPT], dataclasses.replace(GREEDY, ignore_eos=False))[0].outputs[0]
    assert stops.token_ids == greedy_tokens[:first + 1] and stops.finish_reason == "stop"
    ignores = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    assert ignores.token_ids == greedy_tokens and ignores.finish_reason == "length"
    delayed = llm.generate([PROMPT], dataclasses.replace(GREEDY, ignore_eos=False, min_tokens=first + 2))
    tokens = delayed[0].outputs[0].token_ids
    assert eos not in tokens[:first + 2] and len(tokens) >= first + 2


def test_seeded_sampling_is_reproducible_alone_or_batched_and_n_gives_distinct_samples(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    batched = llm.generate([[7] * 30, PROMPT, [1, 2, 3]],
                           [SamplingParams(max_tokens=20, temperature=0.9), p, SamplingParams(temperature=0)])
    assert batched[1].outputs[0].token_ids == alone
    two = llm.generate([PROMPT], dataclasses.replace(p, n=2))[0].outputs
    assert [o.index for o in two] == [0, 1]
    assert two[0].token_ids == alone and two[1].token_ids != alone


def test_logprobs_are_returned_per_token_when_asked(llm, greedy_tokens):
    out = llm.generate([PROMPT], dataclasses.replace(GREEDY, logprobs=3))[0].outputs[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids == greedy_tokens
    for lp in out.logprobs:  # greedy: the chosen token is the best alternative
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].logprobs is None


def test_a_small_fixed_kv_budget_queues_requests_and_still_answers_all(llama, llm):
    prompts = [PROMPT, [3] * 20, [8, 9], [100] * 11]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    small = LLM(llama, page_size=4, kv_cache_tokens=40)  # room for about one request at a time
    assert [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY)] == expected
    assert small.scheduler.num_preemptions > 0  # admitted optimistically, then made room for the oldest
    small.block_manager.check_integrity()
    assert small.block_manager.num_free_pages == small.block_manager.num_total_pages
    with pytest.raises(CapacityError, match="KV pages"):
        small.generate([[3] * 30], dataclasses.replace(GREEDY, max_tokens=50))


def test_beam_search_returns_n_whole_beams_best_first(llm, greedy_tokens):
    params = SamplingParams(max_tokens=6, beam_width=3, n=2, ignore_eos=True)
    [out] = llm.generate([PROMPT], params)
    first, second = out.outputs
    assert [first.index, second.index] == [0, 1]
    assert len(first.token_ids) == len(second.token_ids) == 6 and first.token_ids != second.token_ids
    assert first.cumulative_logprob >= second.cumulative_logprob
    assert first.finish_reason == "length"


def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_tokens(llama):
    llm = LLM(llama, page_size=4)
    prompt = list(range(5, 30))  # 25 tokens: 6 full pages
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 24
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    off = LLM(llama, page_size=4, enable_prefix_caching=False)
    off.generate([prompt], GREEDY)
    assert off.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_generation_stops_at_the_models_context(llama):
    llm = LLM(llama, max_model_len=20)
    out = llm.generate([PROMPT], dataclasses.replace(GREEDY, max_tokens=100))[0].outputs[0]
    assert len(PROMPT) + len(out.token_ids) == 20 and out.finish_reason == "length"


@pytest.fixture(scope="module")
def untouched_llm(llama):
    """Only ever given bad batches: its KV pages must stay empty."""
    return LLM(llama, page_size=4)


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt is empty"),
    ([5] * 256, GREEDY, "context is 256 tokens"),
    ([5, 300], GREEDY, "outside this model's vocabulary"),
    (PROMPT, SamplingParams(max_tokens=0), "max_tokens"),
    (PROMPT, SamplingParams(max_tokens=-3), "max_tokens"),
    (PROMPT, SamplingParams(top_p=0.0), "top_p"),
    (PROMPT, SamplingParams(top_p=1.5), "top_p"),
    (PROMPT, SamplingParams(stop_token_ids=(256,)), "stop token id 256"),
    (PROMPT, SamplingParams(temperature=-0.5), "temperature"),
    (PROMPT, SamplingParams(top_k=0), "top_k"),
    (PROMPT, SamplingParams(min_p=1.5), "min_p"),
    (PROMPT, SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (PROMPT, SamplingParams(presence_penalty=-2.5), "presence_penalty"),
    (PROMPT, SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    (PROMPT, SamplingParams(n=0), "n must be"),
    (PROMPT, SamplingParams(logprobs=21), "logprobs"),
    (PROMPT, SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
    (PROMPT, SamplingParams(beam_width=2, n=3), "must not exceed beam_width"),
    (PROMPT, SamplingParams(regex="a+"), "structured output"),
])
def test_bad_input_is_a_clear_error_before_any_work(untouched_llm, prompt, params, message):
    llm = untouched_llm
    with pytest.raises(InvalidRequestError, match=message):
        # a valid prompt first: it must not have run either
        llm.generate([PROMPT, prompt], [GREEDY, params])
    assert all(not k.any() for k in llm.runner.kv_pool.k_caches)
    assert llm.block_manager.num_used_pages == 0


def test_params_list_must_match_prompts(llm):
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 1 prompts"):
        llm.generate([PROMPT], [GREEDY, GREEDY])


def test_string_prompts_use_the_checkpoints_tokenizer(tmp_path):
    from duet.model_make import make_checkpoint
    from duet.tokenizer import Tokenizer

    path = make_checkpoint(tmp_path / "tiny", preset="tiny", arch="qwen3")
    tok = Tokenizer.from_dir(path)
    llm = LLM(path)
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    text_out, ids_out = llm.generate(["Hello, 世界!", tok.encode("Hello, 世界!")], p)
    assert text_out.prompt == "Hello, 世界!" and text_out.prompt_token_ids == tok.encode("Hello, 世界!")
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert text_out.outputs[0].text == tok.decode(text_out.outputs[0].token_ids)


def test_bfloat16_weights_and_kv_follow_the_fp32_run(llama, greedy_tokens):
    llm = LLM(llama, dtype="bfloat16")
    out = llm.generate([PROMPT], dataclasses.replace(GREEDY, logprobs=0))[0].outputs[0]
    assert llm.runner.kv_pool.k_caches[0].dtype == torch.bfloat16
    assert out.token_ids[:3] == greedy_tokens[:3]  # wide-margin tiny model: the first choices agree
    assert len(out.token_ids) == GREEDY.max_tokens
