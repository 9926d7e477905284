"""vLLM's extra parameters at the API: parsed into sampling fields, bad values named, and the capability
each one needs (what routing step 2 acts on)."""

from __future__ import annotations

import re

import pytest

from gateway.api.extra_params import choice_regex
from gateway.api.protocol import parse_chat, parse_completion
from gateway.errors import InvalidRequest


def chat(**extra):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def test_beam_search_takes_its_width_from_best_of_or_n():
    r = chat(use_beam_search=True, best_of=4, n=2, length_penalty=0.5)
    assert (r.sampling.beam_width, r.sampling.n, r.sampling.length_penalty) == (4, 2, 0.5)
    assert r.required_capabilities == {"beam_search"}
    assert chat(use_beam_search=True, n=3).sampling.beam_width == 3
    assert chat(best_of=2, n=2).sampling.beam_width == 1  # best_of == n without beams: plain sampling
    assert chat(n=2).required_capabilities == {"n"}


@pytest.mark.parametrize("body, field, needle", [
    ({"use_beam_search": "yes"}, "use_beam_search", "boolean"),
    ({"use_beam_search": True}, "best_of", "at least 2"),
    ({"use_beam_search": True, "best_of": 2, "n": 3}, "best_of", "at least 'n'"),
    ({"best_of": 3}, "best_of", "use_beam_search"),
    ({"best_of": 0}, "best_of", "best_of: must be >= 1, got 0"),
    ({"length_penalty": "long"}, "length_penalty", "length_penalty: must be a number"),
    ({"regex": ""}, "regex", "regex: must not be empty"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: must not be empty"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "guided_choice[1]: must be a string, got 3"),
    ({"regex": "a+", "guided_choice": ["a"]}, "guided_choice", "not several"),
    ({"regex": "a+", "response_format": {"type": "json_object"}}, "regex", "not both"),
    ({"speculative": "on"}, "speculative", "boolean"),
    ({"priority": "high"}, "priority", "priority: must be an integer"),
    ({"priority": 1.5}, "priority", "priority: must be an integer, got 1.5"),
    ({"priority": True}, "priority", "priority: must be an integer, got true"),
    ({"priority": 1 << 31}, "priority", "priority: must be <= 2147483647"),
])
def test_bad_extra_parameters_are_named(body, field, needle):
    with pytest.raises(InvalidRequest) as err:
        chat(**body)
    assert err.value.param == field and needle in str(err.value)


def test_guided_choice_is_a_regex_of_exactly_its_choices():
    choices = ["yes", "no", "maybe (a.k.a. 50/50)", "a+b*c?", "[x]{2}|y\\z ^$"]
    pattern = re.compile(choice_regex(choices))
    for c in choices:
        assert pattern.fullmatch(c)
    assert not pattern.fullmatch("yesno") and not pattern.fullmatch("aab") and not pattern.fullmatch("x")
    r = parse_completion({"model": "m", "prompt": "x", "guided_choice": ["yes", "no"]})
    assert r.sampling.regex == "(yes|no)" and r.required_capabilities == {"structured_output"}
    assert chat(guided_regex="[0-9]+").sampling.regex == "[0-9]+"


def test_speculative_on_needs_the_capability_and_off_needs_nothing():
    assert chat(speculative=True).required_capabilities == {"speculative"}
    off = chat(speculative=False)
    assert off.sampling.speculative is False and off.required_capabilities == frozenset()


def test_a_forced_tool_call_and_a_regex_cannot_both_constrain_the_output():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(InvalidRequest) as err:
        chat(tools=tools, tool_choice="required", guided_choice=["a", "b"])
    assert err.value.param == "tool_choice" and "regex" in str(err.value)


def test_a_role_that_is_not_a_string_is_a_400_not_a_crash():
    with pytest.raises(InvalidRequest, match="role"):
        parse_chat({"model": "m", "messages": [{"role": ["user"], "content": "hi"}]})


def test_priority_reaches_the_generate_request_and_needs_no_capability():
    from gateway.serving.generation import Prepared, to_pb

    r = parse_completion({"model": "m", "prompt": "x", "priority": -7})
    assert r.sampling.priority == -7 and r.required_capabilities == frozenset()
    assert chat().sampling.priority == 0 and chat(priority=3.0).sampling.priority == 3
    prep = Prepared(r, None, "rid", [1, 2], "x", 4, "", None, None)
    assert to_pb(prep).priority == -7
