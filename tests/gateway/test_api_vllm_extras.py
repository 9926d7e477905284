"""vLLM's small endpoints and batched completions against a live gateway and sim workers over gRPC:
/tokenize, /detokenize, /version, GET /v1/models/{id} (the SDK's models.retrieve), a list of prompts
in /v1/completions, and `suffix` refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from duet.tokenizer import Tokenizer
from tests.support.stack import model_dir

MODEL = model_dir().name


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(model_dir())


def test_tokenize_a_prompt_and_detokenize_it_back(stack, tok):
    r = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                  "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == [tok.id_to_token(t) for t in body["tokens"]]
    back = httpx.post(stack.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(body["tokens"])}
    # one served model: `model` may be left out, as with vLLM
    assert httpx.post(stack.url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"] == body["tokens"]


def test_tokenize_a_chat_counts_what_chat_completions_bills(stack, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    r = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert r.json()["count"] == usage.prompt_tokens
    without = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "messages": messages,
                                                        "add_generation_prompt": False}).json()
    assert without["count"] < r.json()["count"]  # the assistant header is left out


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"model": MODEL}, "tokens"),
])
def test_bad_tokenizer_requests_are_openai_400s(stack, path, body, param):
    r = httpx.post(stack.url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenize_an_unknown_model_is_a_404(stack):
    r = httpx.post(stack.url + "/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_version(stack):
    r = httpx.get(stack.url + "/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]


def test_models_retrieve_and_an_unknown_id_is_a_404(client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    assert [x.id for x in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_a_batch_of_prompts_gets_one_choice_per_prompt_in_order(client):
    prompts = ["Once upon a time", "The quick brown fox", "In a galaxy"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, p in enumerate(prompts):  # each choice is that prompt's own completion
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=4, seed=5)
        assert r.choices[i].text == alone.choices[0].text
    assert r.usage.completion_tokens == 12
    # with n, choice index = prompt * n + sample, as OpenAI and vLLM number them
    r2 = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=3, n=2, seed=5)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    assert r2.choices[2].text == client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=3, n=2,
                                                           seed=5).choices[0].text


def test_a_streamed_batch_interleaves_choices_and_ends_once(client, stack):
    prompts = [[10, 11, 12], [20, 21, 22]]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=1, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=1)
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 8
    with httpx.stream("POST", stack.url + "/v1/completions",
                      json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines.count("data: [DONE]") == 1 and lines[-1] == "data: [DONE]"
    assert {json.loads(ln[6:])["choices"][0]["index"] for ln in lines[:-1]} == {0, 1}


def test_a_bad_prompt_in_a_batch_fails_the_whole_request_and_leaks_nothing(client, stack):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[1, 2], [10 ** 8]], max_tokens=2)
    assert stack.gateway.pending.count == 0


def test_suffix_is_refused_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f(", suffix="return x", max_tokens=2)
    assert e.value.body["param"] == "suffix" and "not supported" in e.value.body["message"]


def test_echo_with_logprobs_scores_every_prompt_token_and_offsets_follow_the_echo(client, tok):
    prompt = "Once upon a time there was"
    ids = tok.encode(prompt, add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1, echo=True, seed=2)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 3 and len(lp.token_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    # every offset points at its token's text in the returned (echoed) text
    assert lp.text_offset[len(ids)] == len(prompt)
    assert lp.text_offset == sorted(lp.text_offset)
    for off, token in zip(lp.text_offset[len(ids):], lp.tokens[len(ids):]):
        assert c.text[off:].startswith(token) or "\ufffd" in token


def test_max_tokens_zero_with_echo_scores_the_prompt_without_generating(client, tok):
    ids = [5, 6, 7, 8]
    r = client.completions.create(model=MODEL, prompt=[ids, [9, 10]], max_tokens=0, logprobs=1, echo=True)
    assert r.usage.completion_tokens == 0
    first, second = r.choices
    assert first.text == tok.decode(ids) and len(first.logprobs.token_logprobs) == 4
    assert first.logprobs.token_logprobs[0] is None and len(second.logprobs.tokens) == 2
    assert first.finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:  # without echo there is nothing to return
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, extra_body={"prompt_logprobs": 0})
    plp = r.model_extra.get("prompt_logprobs") or r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 3
    assert set(plp[1]) == {"6"} and plp[1]["6"]["logprob"] <= 0


@pytest.mark.parametrize("bias, match", [({"abc": 1}, "keys must be token ids"),
                                         ({"5": 101}, "logit_bias.5: must be <= 100"),
                                         ({"5": "x"}, "logit_bias.5: must be a number"), ({"99999999": 1}, "vocabulary"),
                                         ([1], "logit_bias: must be an object")])
def test_bad_logit_bias_is_a_400_naming_it(client, bias, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias"


def test_sim_applies_logit_bias_to_its_draw(client, tok):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=6, logprobs=0, logit_bias={"42": 100})
    assert r.choices[0].logprobs.tokens == [tok.decode([42], skip_special_tokens=False)] * 6
