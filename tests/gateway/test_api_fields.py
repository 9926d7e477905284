"""Every request field /openapi.json documents does something or is refused: none is accepted and ignored.

For each operation's top-level fields, a sample value is sent on top of a minimal body; what the gateway
makes of the body (the validated ApiRequest that drives the engine call, plus what an API keeps beside it:
the stored conversation, `store`, metadata) must change, or the parser must refuse the value with a 400
naming the field. A field the document gains without a sample here fails the test: decide whether it is
wired or refused, and say so below. The tokenizer endpoints are checked on their answers (no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import model_dir

from gateway.app import build_app
from gateway.config import from_dict
from gateway.errors import InvalidRequest
from gateway.messages_api import parse_request as parse_messages_chat
from gateway.openapi import DOCUMENT
from gateway.protocol import parse_chat, parse_completions
from gateway.responses_input import parse_responses
from gateway.timeouts import client_timeout_s

WIRED, REFUSED = "wired", "refused"
# read and passed on, with no effect this test can see on the tiny model's tokenizer (it adds no special
# tokens of its own); the field is shown to be read by a bad value being refused
READ = "read"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
MSGS = [{"role": "user", "content": "hi"}]
SAMPLING = {  # field: (value, extra base fields, expectation)
    "max_tokens": (7, {}, WIRED), "temperature": (0.5, {}, WIRED), "top_p": (0.5, {}, WIRED),
    "top_k": (5, {}, WIRED), "min_p": (0.1, {}, WIRED), "presence_penalty": (0.5, {}, WIRED),
    "frequency_penalty": (0.5, {}, WIRED), "repetition_penalty": (1.2, {}, WIRED), "seed": (3, {}, WIRED),
    "n": (2, {}, WIRED), "stop": ("x", {}, WIRED), "stop_token_ids": ([5], {}, WIRED),
    "ignore_eos": (True, {}, WIRED), "min_tokens": (2, {"max_tokens": 8}, WIRED), "stream": (True, {}, WIRED),
    "stream_options": ({"include_usage": True}, {}, WIRED), "user": ("u", {}, WIRED),
    "response_format": ({"type": "json_object"}, {}, WIRED), "logit_bias": ({"5": 3}, {}, WIRED),
    "prompt_logprobs": (1, {}, WIRED), "use_beam_search": (True, {"n": 2}, WIRED), "best_of": (3, {"n": 2, "use_beam_search": True}, WIRED),
    "length_penalty": (0.5, {}, WIRED), "regex": ("a+", {}, WIRED), "guided_regex": ("a+", {}, WIRED),
    "guided_choice": (["a", "b"], {}, WIRED), "speculative": (True, {}, WIRED), "priority": (3, {}, WIRED),
    "timeout": (30, {}, WIRED),  # the client's deadline: read beside the parse (gateway.timeouts.client_timeout_s)
}
SAMPLES = {
    "ChatCompletionRequest": ({"model": "m", "messages": MSGS}, {
        **SAMPLING, "model": ("other", {}, WIRED),
        "messages": ([{"role": "user", "content": "other"}], {}, WIRED),
        "max_completion_tokens": (7, {}, WIRED), "logprobs": (True, {}, WIRED),
        "top_logprobs": (3, {"logprobs": True}, WIRED), "tools": ([TOOL], {}, WIRED),
        "tool_choice": ("required", {"tools": [TOOL]}, WIRED)}),
    "CompletionRequest": ({"model": "m", "prompt": "hi"}, {
        **SAMPLING, "model": ("other", {}, WIRED), "prompt": (["a", "b"], {}, WIRED), "echo": (True, {}, WIRED),
        "logprobs": (2, {}, WIRED)}),
    "ResponsesRequest": ({"model": "m", "input": "hi"}, {
        "model": ("other", {}, WIRED), "input": ("other", {}, WIRED), "instructions": ("Be brief.", {}, WIRED),
        "tools": ([{"type": "function", "name": "f"}], {}, WIRED),
        "tool_choice": ("required", {"tools": [{"type": "function", "name": "f"}]}, WIRED),
        "text": ({"format": {"type": "json_object"}}, {}, WIRED), "max_output_tokens": (7, {}, WIRED),
        "temperature": (0.5, {}, WIRED), "top_p": (0.5, {}, WIRED), "store": (False, {}, WIRED),
        "previous_response_id": ("resp_earlier", {}, WIRED), "stream": (True, {}, WIRED),
        "metadata": ({"k": "v"}, {}, WIRED), "user": ("u", {}, WIRED),
        "parallel_tool_calls": (False, {}, REFUSED), "truncation": ("auto", {}, REFUSED)}),
    "MessagesRequest": ({"model": "m", "max_tokens": 4, "messages": MSGS}, {
        "model": ("other", {}, WIRED), "messages": ([{"role": "user", "content": "other"}], {}, WIRED),
        "system": ("Be brief.", {}, WIRED), "tools": ([{"name": "f", "input_schema": {"type": "object"}}], {}, WIRED),
        "tool_choice": ({"type": "any"}, {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, WIRED),
        "max_tokens": (7, {}, WIRED), "stop_sequences": (["x"], {}, WIRED), "temperature": (0.5, {}, WIRED),
        "top_p": (0.5, {}, WIRED), "top_k": (5, {}, WIRED), "stream": (True, {}, WIRED),
        "metadata": ({"user_id": "u"}, {}, WIRED)}),
}
SAMPLES["CountTokensRequest"] = ({"model": "m", "messages": MSGS}, {
    k: v for k, v in SAMPLES["MessagesRequest"][1].items()
    if k in ("model", "messages", "system", "tools", "tool_choice")})
TOKENIZER_SAMPLES = {  # operation schema: (path, base, {field: (value, extra, expectation)})
    "TokenizePromptRequest": ("/tokenize", {"prompt": "hi there"}, {
        "model": ("no-such-model", {}, REFUSED), "prompt": ("other", {}, WIRED),
        "add_special_tokens": (False, {}, READ), "return_token_strs": (True, {}, WIRED)}),
    "TokenizeChatRequest": ("/tokenize", {"messages": MSGS}, {
        "model": ("no-such-model", {}, REFUSED), "messages": ([{"role": "user", "content": "other"}], {}, WIRED),
        "add_generation_prompt": (False, {}, WIRED),
        "continue_final_message": (True, {"messages": [*MSGS, {"role": "assistant", "content": "Hel"}],
                                          "add_generation_prompt": False}, WIRED),
        "add_special_tokens": (True, {}, READ), "return_token_strs": (True, {}, WIRED),
        "tools": ([TOOL], {}, WIRED)}),
    "DetokenizeRequest": ("/detokenize", {"tokens": [5, 6]}, {
        "model": ("no-such-model", {}, REFUSED), "tokens": ([7, 8], {}, WIRED)}),
}
EARLIER = {"conversation": [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}],
           "conversation_id": "resp_earlier"}


def effect(schema: str, body: dict):
    """What the gateway makes of this body before any engine call."""
    if schema == "ChatCompletionRequest":
        return parse_chat(body), client_timeout_s({}, body)
    if schema == "CompletionRequest":
        return parse_completions(body), client_timeout_s({}, body)
    if schema == "ResponsesRequest":
        rr = parse_responses(body, EARLIER if body.get("previous_response_id") else None)
        return parse_chat(rr.chat_body), rr.store, rr.conversation, rr.echo["metadata"]
    return parse_messages_chat(body if schema == "MessagesRequest" else {**body, "max_tokens": 1})


def _properties(schema: str) -> set[str]:
    return set(DOCUMENT["components"]["schemas"][schema]["properties"])


def _request_schemas() -> set[str]:
    found = set()
    for item in DOCUMENT["paths"].values():
        body = item.get("post", {}).get("requestBody")
        if body:
            found.add(body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1])
    return found


def test_every_documented_request_body_has_its_fields_sampled():
    bodies = _request_schemas() - {"TokenizeRequest"} | {"TokenizePromptRequest", "TokenizeChatRequest"}
    assert bodies == set(SAMPLES) | set(TOKENIZER_SAMPLES)
    for schema in bodies:
        fields = (SAMPLES.get(schema) or TOKENIZER_SAMPLES[schema][1:])[-1]
        assert _properties(schema) == set(fields), f"{schema}: sample each new field (wired or refused?)"


@pytest.mark.parametrize("schema, field", [(s, f) for s, (_, fields) in SAMPLES.items() for f in fields])
def test_a_documented_field_changes_the_request_or_is_refused(schema, field):
    base, fields = SAMPLES[schema]
    value, extra, expect = fields[field]
    start = {**base, **extra}
    before = effect(schema, start)
    if expect == REFUSED:
        with pytest.raises(InvalidRequest) as e:
            effect(schema, {**start, field: value})
        assert e.value.param == field
        return
    after = effect(schema, {**start, field: value})
    assert after != before, f"{schema}.{field} = {value!r} was accepted and changed nothing"


@pytest.fixture(scope="module")
def tokenizer_app():
    config = from_dict({"models": [{"path": str(model_dir())}], "workers": []})
    return TestClient(build_app(config))


@pytest.mark.parametrize("schema, field", [(s, f) for s, (_, _, fields) in TOKENIZER_SAMPLES.items()
                                           for f in fields])
def test_a_documented_tokenizer_field_changes_the_answer_or_is_refused(tokenizer_app, schema, field):
    path, base, fields = TOKENIZER_SAMPLES[schema]
    value, extra, expect = fields[field]
    start = {**base, **extra}
    before = tokenizer_app.post(path, json=start)
    after = tokenizer_app.post(path, json={**start, field: value})
    assert before.status_code == 200, before.text
    if expect == REFUSED:
        assert 400 <= after.status_code < 500
        return
    if expect == READ:
        assert after.status_code == 200
        bad = tokenizer_app.post(path, json={**start, field: "not-a-boolean"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field
        return
    assert after.status_code == 200 and after.json() != before.json(), f"{schema}.{field} changed nothing"
