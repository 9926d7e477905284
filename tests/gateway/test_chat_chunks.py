"""The SSE of a streamed answer's text tokens (gateway/serving/chat_chunks.py): `ChunkBuilder.text_sse`, the
templated fast path, gives the very bytes the general rendering gives, for every shape of request it serves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.api.protocol import parse_chat, parse_completions
from gateway.serving.chat_chunks import ChunkBuilder, sse
from gateway.serving.events import Content, Finish, TokenLogprob, Usage

TEXTS = ["Hello", " world", 'quo"te\\back', "new\nline\ttab", "東京 ☃ 🙂", "\u2028\x00\x1f", "</script>"]


def _builder(api, model_id: str = "tiny-model", index_offset: int = 0) -> ChunkBuilder:
    prep = SimpleNamespace(api=api, model=SimpleNamespace(model_id=model_id, tokenizer=None), request_id="r1",
                           prompt_text="the prompt", prompt_ids=[1, 2, 3])
    return ChunkBuilder(SimpleNamespace(prep=prep, prompt_logprobs=[]), index_offset)


def _requests():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    completion = {"model": "m", "prompt": "hi", "stream": True}
    yield "chat", parse_chat(chat)
    yield "chat n=2, usage", parse_chat({**chat, "n": 2, "stream_options": {"include_usage": True}})
    yield "completion", parse_completions(completion)[0]
    yield "completion echo, usage", parse_completions({**completion, "echo": True,
                                                       "stream_options": {"include_usage": True}})[0]


@pytest.mark.parametrize("name,api", list(_requests()), ids=[n for n, _ in _requests()])
def test_a_text_token_renders_to_the_same_bytes_as_the_general_path(name, api):
    for offset in (0, 3):
        fast, general = _builder(api, index_offset=offset), _builder(api, index_offset=offset)
        general.created = fast.created  # made in the same second or not: the same chunk
        for choice in range(api.sampling.n):
            for text in TEXTS:
                events = [Content(text, choice)]
                assert fast.text_sse(events) == sse(general.chunks(events)[0]), (name, text)


def test_what_the_template_does_not_cover_takes_the_general_path():
    api = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    b = _builder(api)
    assert b.text_sse([Content("a"), Content("b")]) is None  # several events in one message
    assert b.text_sse([Content("a"), Finish(0, "stop", None, Usage(3, 0, 1))]) is None  # the finish rides on it
    assert b.text_sse([Content("")]) is None  # nothing to show: chat sends no chunk
    # logprobs the request did not ask for are not rendered either way
    with_lps = [Content("a", 0, (TokenLogprob("a", -0.1, ()),))]
    assert b.text_sse(with_lps) == sse(b.chunks(with_lps)[0])
    with_logprobs = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                "logprobs": True})
    assert _builder(with_logprobs).text_sse([Content("a")]) is None
    # a model named like the placeholder cannot be templated: it still renders right, the general way
    odd = _builder(api, model_id="\x00duet-text\x00")
    assert odd.text_sse([Content("a")]) is None
