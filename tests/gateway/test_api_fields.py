"""Every request field /openapi.json documents does something or is refused: none is accepted and ignored.

For each operation's fields, nested ones too (messages[].content[].text, tools[].function.name,
response_format.json_schema.schema, Responses input items, Messages content blocks), a sample body is
compared with a minimal one; what the gateway makes of the body (the validated ApiRequest that drives the engine call, plus what an API keeps beside it:
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

from gateway.api.messages import parse_request as parse_messages_chat
from gateway.api.messages_input import CountTokensRequest
from gateway.api.protocol import parse_chat, parse_completions
from gateway.api.responses_input import parse_responses
from gateway.app import build_app
from gateway.config import from_dict
from gateway.errors import InvalidRequest
from gateway.openapi import DOCUMENT
from gateway.serving.timeouts import client_timeout_s

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
    "timeout": (30, {}, WIRED),  # the client's deadline: read beside the parse (gateway.serving.timeouts.client_timeout_s)
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

# -- nested fields: (fields before, fields after, expectation), both on top of the schema's base body ----
# LABEL: a name the client gives for its own bookkeeping (OpenAI requires it); it cannot change the output
LABEL = "label"
TOOL_G = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _turns(call: dict = CALL, answers: str = "c1") -> list[dict]:
    return [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": answers, "content": "1"}]


def _msg(**kw) -> list[dict]:
    return [{"role": "user", "content": "hi", **kw}]


def _parts(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


NAMED = {"tools": [TOOL, TOOL_G], "tool_choice": {"type": "function", "function": {"name": "f"}}}
OPENAI_FORMAT = {  # response_format and stream_options: both OpenAI endpoints
    "response_format.type": ({}, {"response_format": {"type": "json_object"}}, WIRED),
    "response_format.json_schema": ({"response_format": {"type": "json_object"}},
                                    {"response_format": SCHEMA_FORMAT}, WIRED),
    "response_format.json_schema.schema": ({"response_format": SCHEMA_FORMAT}, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}}, WIRED),
    "response_format.json_schema.name": ({"response_format": SCHEMA_FORMAT}, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "y", "schema": {"type": "object"}}}}, LABEL),
    "stream_options.include_usage": ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}},
                                     WIRED),
}
NESTED = {
    "ChatCompletionRequest": {
        **OPENAI_FORMAT,
        "messages[].role": ({}, {"messages": [{"role": "developer", "content": "hi"}]}, WIRED),
        "messages[].content": ({}, {"messages": [{"role": "user", "content": "other"}]}, WIRED),
        "messages[].content[].type": ({}, {"messages": _parts({"type": "image_url", "text": "hi"})}, REFUSED),
        "messages[].content[].text": ({"messages": _parts({"type": "text", "text": "hi"})},
                                      {"messages": _parts({"type": "text", "text": "other"})}, WIRED),
        "messages[].name": ({}, {"messages": _msg(name="ann")}, WIRED),
        "messages[].tool_calls": ({"messages": MSGS}, {"messages": _turns()[:2]}, WIRED),
        "messages[].tool_call_id": ({"messages": _turns()}, {"messages": _turns(answers="c2")}, REFUSED),
        "messages[].tool_calls[].id": ({"messages": _turns()}, {"messages": _turns({**CALL, "id": "c2"}, "c2")},
                                       WIRED),
        "messages[].tool_calls[].type": ({"messages": _turns()}, {"messages": _turns({**CALL, "type": "x"})},
                                         REFUSED),
        "messages[].tool_calls[].function": ({"messages": _turns()}, {"messages": _turns(
            {**CALL, "function": {"name": "g", "arguments": '{"a": 1}'}})}, WIRED),
        "messages[].tool_calls[].function.name": ({"messages": _turns()}, {"messages": _turns(
            {**CALL, "function": {"name": "g", "arguments": "{}"}})}, WIRED),
        "messages[].tool_calls[].function.arguments": ({"messages": _turns()}, {"messages": _turns(
            {**CALL, "function": {"name": "f", "arguments": '{"a": 1}'}})}, WIRED),
        "tool_choice.type": ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": {
            "type": "other", "function": {"name": "f"}}}, REFUSED),
        "tool_choice.function": (NAMED, {**NAMED, "tool_choice": {"type": "function", "function": {"name": "g"}}},
                                 WIRED),
        "tool_choice.function.name": (NAMED, {**NAMED, "tool_choice": {"type": "function",
                                                                       "function": {"name": "g"}}}, WIRED),
        "tools[].type": ({}, {"tools": [{**TOOL, "type": "retrieval"}]}, REFUSED),
        "tools[].function": ({"tools": [TOOL]}, {"tools": [TOOL_G]}, WIRED),
        "tools[].function.name": ({"tools": [TOOL]}, {"tools": [{"type": "function", "function": {
            "name": "h", "parameters": {"type": "object"}}}]}, WIRED),
        "tools[].function.description": ({"tools": [TOOL]}, {"tools": [{"type": "function", "function": {
            "name": "f", "description": "does f", "parameters": {"type": "object"}}}]}, WIRED),
        "tools[].function.parameters": ({"tools": [TOOL]}, {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "required": ["a"]}}}]}, WIRED),
    },
    "CompletionRequest": OPENAI_FORMAT,
}
FC = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
FCO = {"type": "function_call_output", "call_id": "c1", "output": "1"}
USER = {"role": "user", "content": "hi"}
R_TOOL = {"type": "function", "name": "f"}


def _items(call: dict = FC, output: dict = FCO) -> list[dict]:
    return [USER, call, output]


NESTED["ResponsesRequest"] = {
    "input[].role": ({"input": [USER]}, {"input": [{"role": "developer", "content": "hi"}]}, WIRED),
    "input[].type": ({"input": [USER]}, {"input": [{**USER, "type": "reasoning"}]}, REFUSED),
    "input[].content": ({"input": [USER]}, {"input": [{"role": "user", "content": "other"}]}, WIRED),
    "input[].content[].type": ({"input": [USER]}, {"input": [{"role": "user", "content": [
        {"type": "input_image", "text": "hi"}]}]}, REFUSED),
    "input[].content[].text": ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
                               {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]},
                               WIRED),
    "input[].call_id": ({"input": _items()}, {"input": _items(output={**FCO, "call_id": "c2"})}, REFUSED),
    "input[].name": ({"input": _items()}, {"input": _items({**FC, "name": "g"})}, WIRED),
    "input[].arguments": ({"input": _items()}, {"input": _items({**FC, "arguments": '{"a": 1}'})}, WIRED),
    "input[].output": ({"input": _items()}, {"input": _items(output={**FCO, "output": "2"})}, WIRED),
    "input[].output[].type": ({"input": _items()}, {"input": _items(output={**FCO, "output": [
        {"type": "input_image", "text": "2"}]})}, REFUSED),
    "input[].output[].text": ({"input": _items()}, {"input": _items(output={**FCO, "output": [
        {"type": "input_text", "text": "2"}]})}, WIRED),
    "text.format": ({}, {"text": {"format": {"type": "json_object"}}}, WIRED),
    "text.format.type": ({"text": {"format": {"type": "text"}}}, {"text": {"format": {"type": "json_object"}}},
                         WIRED),
    "text.format.schema": ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
                           {"text": {"format": {"type": "json_schema", "schema": {"type": "array"}}}}, WIRED),
    "text.format.name": ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}},
                         {"text": {"format": {"type": "json_schema", "name": "b", "schema": {"type": "object"}}}},
                         LABEL),
    "tool_choice.type": ({"tools": [R_TOOL]}, {"tools": [R_TOOL], "tool_choice": {"type": "x", "name": "f"}},
                         REFUSED),
    "tool_choice.name": ({"tools": [R_TOOL, {**R_TOOL, "name": "g"}], "tool_choice": {"type": "function",
                                                                                     "name": "f"}},
                         {"tools": [R_TOOL, {**R_TOOL, "name": "g"}], "tool_choice": {"type": "function",
                                                                                     "name": "g"}}, WIRED),
    "tools[].type": ({}, {"tools": [{**R_TOOL, "type": "web_search"}]}, REFUSED),
    "tools[].name": ({"tools": [R_TOOL]}, {"tools": [{**R_TOOL, "name": "g"}]}, WIRED),
    "tools[].description": ({"tools": [R_TOOL]}, {"tools": [{**R_TOOL, "description": "does f"}]}, WIRED),
    "tools[].parameters": ({"tools": [R_TOOL]}, {"tools": [{**R_TOOL, "parameters": {"type": "object"}}]}, WIRED),
}
A_TOOL = {"name": "f", "input_schema": {"type": "object"}}
TU = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
TR = {"type": "tool_result", "tool_use_id": "t1", "content": "1"}


def _uses(use: dict = TU, result: dict = TR) -> dict:
    return {"tools": [A_TOOL], "messages": [*MSGS, {"role": "assistant", "content": [use]},
                                            {"role": "user", "content": [result]}]}


def _blocks(*blocks) -> dict:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


NESTED["MessagesRequest"] = {
    "messages[].role": ({}, {"messages": [{"role": "assistant", "content": "hi"}]}, WIRED),
    "messages[].content": ({}, {"messages": [{"role": "user", "content": "other"}]}, WIRED),
    "messages[].content[].type": ({}, _blocks({"type": "image", "text": "hi"}), REFUSED),
    "messages[].content[].text": (_blocks({"type": "text", "text": "hi"}), _blocks({"type": "text", "text": "x"}),
                                  WIRED),
    "messages[].content[].id": (_uses(), _uses({**TU, "id": "t2"}, {**TR, "tool_use_id": "t2"}), WIRED),
    "messages[].content[].name": (_uses(), _uses({**TU, "name": "g"}), WIRED),
    "messages[].content[].input": (_uses(), _uses({**TU, "input": {"a": 1}}), WIRED),
    "messages[].content[].tool_use_id": (_uses(), _uses(result={**TR, "tool_use_id": "t9"}), REFUSED),
    "messages[].content[].content": (_uses(), _uses(result={**TR, "content": "2"}), WIRED),
    "messages[].content[].content[].type": (_uses(), _uses(result={**TR, "content": [{"type": "image", "text": "2"}]}),
                                            REFUSED),
    "messages[].content[].content[].text": (_uses(), _uses(result={**TR, "content": [{"type": "text", "text": "2"}]}),
                                            WIRED),
    "messages[].content[].is_error": (_uses(), _uses(result={**TR, "is_error": True}), WIRED),
    "metadata.user_id": ({"metadata": {}}, {"metadata": {"user_id": "u"}}, WIRED),
    "system[].type": ({}, {"system": [{"type": "image", "text": "x"}]}, REFUSED),
    "system[].text": ({"system": [{"type": "text", "text": "a"}]}, {"system": [{"type": "text", "text": "b"}]}, WIRED),
    "tool_choice.type": ({"tools": [A_TOOL]}, {"tools": [A_TOOL], "tool_choice": {"type": "any"}}, WIRED),
    "tool_choice.name": ({"tools": [A_TOOL, {**A_TOOL, "name": "g"}], "tool_choice": {"type": "tool", "name": "f"}},
                         {"tools": [A_TOOL, {**A_TOOL, "name": "g"}], "tool_choice": {"type": "tool", "name": "g"}},
                         WIRED),
    "tool_choice.disable_parallel_tool_use": ({"tools": [A_TOOL]}, {"tools": [A_TOOL], "tool_choice": {
        "type": "auto", "disable_parallel_tool_use": True}}, REFUSED),
    "tools[].type": ({}, {"tools": [{**A_TOOL, "type": "web_search_20250305"}]}, REFUSED),
    "tools[].name": ({"tools": [A_TOOL]}, {"tools": [{**A_TOOL, "name": "g"}]}, WIRED),
    "tools[].description": ({"tools": [A_TOOL]}, {"tools": [{**A_TOOL, "description": "does f"}]}, WIRED),
    "tools[].input_schema": ({"tools": [A_TOOL]}, {"tools": [{**A_TOOL, "input_schema": {"type": "array"}}]},
                             WIRED),
}
# these bodies reuse another's nested models, walked there
SHARED_NESTED = {"CountTokensRequest": "MessagesRequest", "TokenizeChatRequest": "ChatCompletionRequest"}


def effect(schema: str, body: dict):
    """What the gateway makes of this body before any engine call."""
    if schema == "ChatCompletionRequest":
        return parse_chat(body), client_timeout_s({}, body)
    if schema == "CompletionRequest":
        return parse_completions(body), client_timeout_s({}, body)
    if schema == "ResponsesRequest":
        rr = parse_responses(body, EARLIER if body.get("previous_response_id") else None)
        return parse_chat(rr.chat_body), rr.store, rr.conversation, rr.echo["metadata"]
    if schema == "MessagesRequest":
        return parse_messages_chat(body)
    return parse_messages_chat(body, CountTokensRequest)


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = DOCUMENT["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def field_paths(schema: dict, prefix: str = "") -> set[str]:
    """Every field a body may hold, nested ones as `messages[].content[].text` (union branches merged)."""
    schema = _resolve(schema)
    found: set[str] = set()
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        found |= field_paths(branch, prefix)
    if schema.get("type") == "array" and "items" in schema:
        found |= field_paths(schema["items"], prefix + "[]")
    for name, prop in schema.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        found |= {path} | field_paths(prop, path)
    return found


def _top_level(path: str) -> str:
    return path.split(".")[0].split("[")[0]


def _request_schemas() -> set[str]:
    found = set()
    for item in DOCUMENT["paths"].values():
        body = item.get("post", {}).get("requestBody")
        if body:
            schema = body["content"]["application/json"]["schema"]
            found |= {r["$ref"].rsplit("/", 1)[1] for r in schema.get("oneOf", [schema])}
    return found


def test_every_documented_request_field_is_sampled_nested_ones_too():
    assert _request_schemas() == set(SAMPLES) | set(TOKENIZER_SAMPLES)
    for schema in _request_schemas():
        fields = SAMPLES[schema][1] if schema in SAMPLES else TOKENIZER_SAMPLES[schema][2]
        paths = field_paths(DOCUMENT["components"]["schemas"][schema])
        top = {p for p in paths if p == _top_level(p)}
        assert top == set(fields), f"{schema}: sample each new field (wired or refused?)"
        nested = paths - top
        walked = NESTED.get(SHARED_NESTED.get(schema, schema), {})
        if schema in SHARED_NESTED:
            assert nested <= set(walked), f"{schema}: {sorted(nested - set(walked))} are not walked"
        else:
            assert nested == set(walked), f"{schema}: sample each new nested field: {sorted(nested ^ set(walked))}"


def _check(schema: str, before_body: dict, after_body: dict, expect: str, field: str) -> None:
    before = effect(schema, before_body)
    if expect == REFUSED:
        with pytest.raises(InvalidRequest) as e:
            effect(schema, after_body)
        assert e.value.param == _top_level(field), e.value.message
        return
    after = effect(schema, after_body)
    if expect == LABEL:
        assert after == before, f"{schema}.{field} is a label, yet it changed the request"
        return
    assert after != before, f"{schema}.{field} was accepted and changed nothing"


@pytest.mark.parametrize("schema, field", [(s, f) for s, (_, fields) in SAMPLES.items() for f in fields])
def test_a_documented_field_changes_the_request_or_is_refused(schema, field):
    base, fields = SAMPLES[schema]
    value, extra, expect = fields[field]
    _check(schema, {**base, **extra}, {**base, **extra, field: value}, expect, field)


@pytest.mark.parametrize("schema, field", [(s, f) for s, fields in NESTED.items() for f in fields])
def test_a_documented_nested_field_changes_the_request_or_is_refused(schema, field):
    base = SAMPLES[schema][0]
    before, after, expect = NESTED[schema][field]
    _check(schema, {**base, **before}, {**base, **after}, expect, field)


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
