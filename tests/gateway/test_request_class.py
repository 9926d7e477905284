"""The traffic class (gateway/serving/request_class.py): the pure rule on parsed requests, and the `class` label a
request leaves on the gateway's TTFT, inter-token and e2e histograms (a live gateway over sim workers)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import openai

from gateway.api.protocol import parse_chat, parse_completions
from gateway.serving.request_class import CLASSES, DOCUMENT_PROMPT_TOKENS, request_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import model_dir

MODEL = model_dir().name
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(*turns: str, **kw):
    messages = []
    for i, t in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": t})
    return parse_chat({"model": "m", "messages": messages, **kw})


def test_a_short_single_turn_is_oneshot():
    assert request_class(_chat("hi"), None, 12) == "oneshot"
    assert request_class(parse_completions({"model": "m", "prompt": "hi"})[0], None, 3) == "oneshot"


def test_a_session_key_or_a_second_user_turn_is_a_session():
    assert request_class(_chat("hi"), "conv-1", 12) == "session"
    assert request_class(_chat("hi", "and then?"), None, 40) == "session"
    assert request_class(_chat("hi", "and then?"), None, 5000) == "session"  # a long conversation is still one


def test_a_long_one_shot_prompt_is_a_document():
    api = parse_completions({"model": "m", "prompt": "x"})[0]
    assert request_class(api, None, DOCUMENT_PROMPT_TOKENS - 1) == "oneshot"
    assert request_class(api, None, DOCUMENT_PROMPT_TOKENS) == "document"
    assert request_class(api, None, 100, document_tokens=100) == "document"


def test_structured_output_wins_over_every_other_class():
    for kw in ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
               {"response_format": {"type": "json_object"}},
               {"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
                "tool_choice": "required"}):
        assert request_class(_chat("hi", "again", **kw), "conv-1", 5000) == "structured", kw
    # tools offered but switched off are plain text
    off = _chat("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}], tool_choice="none")
    assert request_class(off, None, 12) == "oneshot"


def test_every_answer_is_one_of_four_classes():
    assert len(CLASSES) == 4
    apis = [_chat("hi"), _chat("a", "b"), parse_completions({"model": "m", "prompt": "x"})[0],
            _chat("hi", response_format={"type": "json_object"})]
    assert {request_class(a, k, n) for a in apis for k in (None, "s") for n in (1, 5000)} <= set(CLASSES)


def _classes_on(text: str, metric: str) -> set[str]:
    return set(re.findall(metric + r'_count\{[^}]*class="([a-z]+)"', text))


def test_each_request_leaves_its_class_on_the_latency_histograms(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    msg = [{"role": "user", "content": "Tell me a story."}]
    list(client.chat.completions.create(model=MODEL, messages=msg, max_tokens=4, stream=True))
    list(client.chat.completions.create(model=MODEL, messages=msg, max_tokens=4, stream=True,
                                        extra_headers={"x-session-id": "s-1"}))
    client.completions.create(model=MODEL, prompt=[5 + i % 500 for i in range(DOCUMENT_PROMPT_TOKENS)], max_tokens=4)
    client.chat.completions.create(model=MODEL, messages=msg, max_tokens=4,
                                   response_format={"type": "json_object"})
    text = httpx.get(stack.url + "/metrics").text
    for metric in ("duet_time_to_first_token_seconds", "duet_e2e_request_latency_seconds"):
        assert _classes_on(text, metric) == set(CLASSES), metric
    assert "session" in _classes_on(text, "duet_inter_token_latency_seconds")
    # the label set is model, engine, variant, class: the dashboards' `sum by` still sees one model
    doc = [ln for ln in text.splitlines() if ln.startswith("duet_time_to_first_token_seconds_count{")
           and 'class="document"' in ln]
    assert len(doc) == 1 and f'model="{MODEL}"' in doc[0] and 'variant="' in doc[0], doc
