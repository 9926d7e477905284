"""Hostile input at the edge: every body gets a 2xx or a typed OpenAI error object, never a plain 500.

The cases come from a fuzzing session against `duet up` (issue 14): deep nesting, lone surrogates in
the prompt, the messages and the model name, token ids past uint32, integers past Python's int-string
limit, non-finite numbers. Each answered a plain-text 500 before gateway/body_parser.py existed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from gateway.body_parser import MAX_DEPTH, parse_json_body
from gateway.errors import InvalidRequest
from gateway.middleware import ErrorShieldMiddleware, RequestIdMiddleware

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import model_dir

MODEL = model_dir().name


@pytest.fixture
def gw(stack):  # tests/gateway/conftest.py
    return stack


def _post(gw, path: str, raw: str | bytes) -> httpx.Response:
    return httpx.post(gw.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


def _assert_openai_400(r: httpx.Response, needle: str, param: str | None = None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err
    if param is not None:
        assert err["param"] == param
    assert r.headers["x-request-id"]


def test_json_nested_1000_deep_is_a_400(gw):
    raw = f'{{"model": "{MODEL}", "prompt": "hi", "x": {"[" * 1000}1{"]" * 1000}}}'
    _assert_openai_400(_post(gw, "/v1/completions", raw), "nests deeper than")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x\ud800"}]}),
    ("/v1/chat/completions", {"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_lone_surrogate_anywhere_is_a_400(gw, path, body):
    _assert_openai_400(_post(gw, path, json.dumps(body)), "lone UTF-16 surrogate")


def test_escaped_surrogate_pair_is_an_emoji_and_works(gw):
    raw = json.dumps({"model": MODEL, "prompt": "smile \U0001F600", "max_tokens": 2})
    assert "\\ud83d\\ude00" in raw
    r = _post(gw, "/v1/completions", raw)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_token_id_past_uint32_is_a_400(gw):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop_token_ids": [1_000_000_000_000]}
    _assert_openai_400(_post(gw, "/v1/completions", json.dumps(body)), "stop_token_ids", "stop_token_ids")


@pytest.mark.parametrize("literal", ["1" * 5000, "-" + "9" * 5000, "1" + "0" * 70])
def test_integer_with_thousands_of_digits_is_a_400(gw, literal):
    raw = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": {literal}}}'
    _assert_openai_400(_post(gw, "/v1/completions", raw), "digits")


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_a_400(gw, literal):
    raw = f'{{"model": "{MODEL}", "prompt": "hi", "temperature": {literal}}}'
    _assert_openai_400(_post(gw, "/v1/completions", raw), "finite")


def test_invalid_utf8_is_a_400_and_the_gateway_still_serves(gw):
    _assert_openai_400(_post(gw, "/v1/completions", b'{"model": "\xff\xfe"}'), "UTF-8")
    r = _post(gw, "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))
    assert r.status_code == 200


def test_parser_bounds_depth_but_not_brackets_inside_strings():
    assert parse_json_body(json.dumps({"prompt": "[" * 5000 + "{" * 5000})) == {"prompt": "[" * 5000 + "{" * 5000}
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json_body(ok) is not None
    with pytest.raises(InvalidRequest):
        parse_json_body("[" + ok + "]")
    # an escaped quote does not end the string the depth scan skips
    assert parse_json_body(json.dumps({"a": 'x\\"[[[' * 100})) == {"a": 'x\\"[[[' * 100}


def test_a_surrogate_in_a_key_is_refused():
    with pytest.raises(InvalidRequest, match="surrogate"):
        parse_json_body('{"\\udc00": 1}')


async def test_an_unexpected_exception_becomes_an_openai_500_object():
    async def broken(request):
        raise RuntimeError("a bug")

    app = Starlette(routes=[Route("/x", broken)],  # the same order as gateway/app.py
                    middleware=[Middleware(RequestIdMiddleware), Middleware(ErrorShieldMiddleware)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://gw") as c:
        r = await c.get("/x")
    assert r.status_code == 500 and r.headers["x-request-id"]
    assert r.json()["error"]["type"] == "internal_error" and "RuntimeError" in r.json()["error"]["message"]


def test_tokenizer_refuses_a_lone_surrogate_with_its_own_error():
    from duet.tokenizer import Tokenizer, TokenizerError

    tok = Tokenizer.from_dir(model_dir())
    with pytest.raises(TokenizerError, match="not valid Unicode"):
        tok.encode("ok \ud800")
    assert tok.decode(tok.encode("ok \U0001F600")) == "ok \U0001F600"


def test_integral_floats_are_integers_as_json_schema_says():
    from gateway.api.protocol import parse_completion

    api = parse_completion({"model": "m", "prompt": "x", "n": 2.0, "max_tokens": 16.0, "seed": 0.0})
    assert (api.sampling.n, api.sampling.max_tokens, api.sampling.seed) == (2, 16, 0)
    assert isinstance(api.sampling.max_tokens, int)
    with pytest.raises(InvalidRequest, match="n: must be an integer, got 2.5"):
        parse_completion({"model": "m", "prompt": "x", "n": 2.5})


async def test_an_exception_mid_stream_ends_the_stream_with_an_error_event():
    from starlette.responses import StreamingResponse

    async def events():
        yield b'data: {"choices": []}\n\n'
        raise RuntimeError("a bug mid-stream")

    async def streaming(request):
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", streaming)],
                    middleware=[Middleware(RequestIdMiddleware), Middleware(ErrorShieldMiddleware)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://gw") as c:
        r = await c.get("/s")
    lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["type"] == "internal_error"


def test_unknown_paths_and_wrong_methods_are_openai_errors(gw):
    r = httpx.get(gw.url + "/v1/no-such-endpoint")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and r.headers["x-request-id"]
    r = httpx.get(gw.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]
