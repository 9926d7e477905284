"""Request parsing and stop strings without a network: what a client sends -> what the engine is asked."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.api.protocol import parse_chat, parse_completion
from gateway.errors import InvalidRequest
from gateway.serving.stops import StopMatcher

MSG = [{"role": "user", "content": "hi"}]


@given(text=st.text(alphabet="abcxy ", max_size=60), stops=st.lists(st.text(alphabet="abcxy", min_size=1,
       max_size=4), min_size=1, max_size=3), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_stop_matcher_cuts_where_a_stop_is_first_completed_however_the_text_is_split(text, stops, cuts):
    pieces, prev = [], 0
    for c in sorted({min(c, len(text)) for c in cuts}) + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    m = StopMatcher(tuple(stops))
    out = "".join(m.push(p) for p in pieces) + m.flush()
    # the oracle, on the whole text: the occurrence that ends first (at a tie, the one that starts first)
    hits = sorted((i + len(s), i) for s in stops if (i := text.find(s)) >= 0)
    assert out == (text[: hits[0][1]] if hits else text)
    assert m.stopped == bool(hits)


def test_a_stop_completed_earlier_wins_over_a_longer_one_that_starts_earlier():
    for pieces in (["baa"], ["ba", "a"], ["b", "a", "a"]):
        m = StopMatcher(("a", "baa"))
        assert "".join(m.push(p) for p in pieces) + m.flush() == "b" and m.matched == "a"


def test_chat_fields_map_to_sampling():
    r = parse_chat({"model": "m", "messages": MSG, "max_tokens": 5, "max_completion_tokens": 7, "stop": "END",
                    "logprobs": True, "top_logprobs": 2, "seed": 3, "user": "u1", "n": 2,
                    "stream": True, "stream_options": {"include_usage": True}, "unknown_field": [1, 2]})
    s = r.sampling
    assert (s.max_tokens, s.stop, s.logprobs, s.top_logprobs, s.seed, s.n) == (7, ("END",), True, 2, 3, 2)
    assert r.stream and r.include_usage and r.user == "u1"
    assert r.required_capabilities == frozenset({"n"})


def test_response_format_becomes_an_engine_constraint_and_needs_structured_output():
    r = parse_chat({"model": "m", "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert r.sampling.json_schema == '{"type": "object"}'
    assert "structured_output" in r.required_capabilities
    assert parse_chat({"model": "m", "messages": MSG, "response_format": {"type": "json_object"}}).sampling.json_object


def test_completions_integer_logprobs_and_token_prompts():
    r = parse_completion({"model": "m", "prompt": [1, 2, 3], "logprobs": 0})
    assert r.prompt == (1, 2, 3) and r.sampling.logprobs and r.sampling.top_logprobs == 0
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"


def test_content_parts_are_joined():
    r = parse_chat({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.messages[0]["content"] == "ab"


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"model": "m", "messages": MSG, "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": MSG, "top_p": 0}, "top_p"),
    ({"model": "m", "messages": MSG, "n": 0}, "n"),
    ({"model": "m", "messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"model": "m", "messages": MSG, "stop": ["ok", ""]}, "stop"),
    ({"model": "m", "messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "messages": MSG, "response_format": {"type": "yaml"}}, "response_format"),
    ({"model": "m", "messages": MSG, "presence_penalty": 3}, "presence_penalty"),
])
def test_bad_chat_parameters_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_chat(body)
    assert e.value.param == param and e.value.status == 400


def test_bad_completion_prompt():
    for prompt in (None, 5, [1, "a"], [[1], [2]]):
        with pytest.raises(InvalidRequest) as e:
            parse_completion({"model": "m", "prompt": prompt})
        assert e.value.param == "prompt"
