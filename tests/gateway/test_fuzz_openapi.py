"""Property-based fuzzing of the public API from its own OpenAPI document (/openapi.json) with
schemathesis, against a gateway in front of two sim worker processes over real gRPC: valid and
invalid bodies alike must get a 2xx or a 4xx OpenAI error object, never a 5xx; afterwards the stack
still serves. A fast tier: the example budget keeps it about a minute on two cores."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from gateway.api import answer_models
from gateway.openapi import DOCUMENT
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir, start_sims

MODEL = model_dir().name
EXAMPLES = 75  # per POST operation and generation mode (valid, invalid): 300 generation requests


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory):
    sims = start_sims([Sim("prefix", ms_per_token=0.2), Sim("paged", ms_per_token=0.2)],
                      tmp_path_factory.mktemp("sims"))
    # max_tokens unset fills the context: cap it so a valid request costs milliseconds
    g = GatewayThread(gateway_config(sims, limits={"default_max_tokens": 8})).start()
    yield g
    g.stop()
    for s in sims:
        s.kill()


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
OPERATIONS = [("POST", "/v1/chat/completions", POSITIVE), ("POST", "/v1/chat/completions", NEGATIVE),
              ("POST", "/v1/completions", POSITIVE), ("POST", "/v1/completions", NEGATIVE),
              ("POST", "/v1/responses", POSITIVE), ("POST", "/v1/responses", NEGATIVE),
              ("POST", "/v1/messages", POSITIVE), ("POST", "/v1/messages", NEGATIVE),
              ("POST", "/v1/messages/count_tokens", POSITIVE), ("POST", "/v1/messages/count_tokens", NEGATIVE),
              ("GET", "/v1/responses/{response_id}", POSITIVE), ("DELETE", "/v1/responses/{response_id}", POSITIVE),
              ("POST", "/tokenize", POSITIVE), ("POST", "/tokenize", NEGATIVE),
              ("POST", "/detokenize", POSITIVE), ("POST", "/detokenize", NEGATIVE),
              ("GET", "/v1/models/{model_id}", POSITIVE),
              # no parameters: one request each, and nothing to make invalid
              ("GET", "/v1/models", POSITIVE), ("GET", "/health", POSITIVE), ("GET", "/ready", POSITIVE),
              ("GET", "/version", POSITIVE)]
GENERATION = ("/v1/chat/completions", "/v1/completions")
SERVED_CHECK = {  # one plain body per generation operation: valid bodies do get served
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
ANSWERS = {"/v1/chat/completions": answer_models.ChatCompletion, "/v1/completions": answer_models.Completion,
           "/v1/responses": answer_models.Response, "/v1/messages": answer_models.Message}
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)


@pytest.mark.parametrize("method, path, mode", OPERATIONS, ids=lambda x: getattr(x, "value", x))
def test_no_input_gets_a_5xx_and_every_4xx_is_an_openai_error(fuzz_gateway, method, path, mode):
    operation = SCHEMA[path][method]
    seen = {"count": 0, "2xx": 0, "4xx": 0}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=(EXAMPLES if path in GENERATION else EXAMPLES // 3) if method == "POST" else 10, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and case.body["model"] != MODEL:
            case.body["model"] = MODEL  # the served model, so that the requests get past the 404
        r = case.call(base_url=fuzz_gateway.url, timeout=30)
        seen["count"] += 1
        assert r.status_code < 500, f"{method} {path} {case.body!r} -> {r.status_code} {r.text[:500]}"
        if r.status_code >= 400:  # OpenAI's error shape, or Anthropic's on /v1/messages*, as documented
            shape = answer_models.AnthropicError if path.startswith("/v1/messages") else answer_models.ErrorResponse
            shape.model_validate(r.json())
            seen["4xx"] += 1
        else:
            seen["2xx"] += 1

    check()
    assert seen["count"] >= ((EXAMPLES // 2 if path in GENERATION else EXAMPLES // 6) if method == "POST" else 1)
    if path in SERVED_CHECK and mode == POSITIVE:  # valid bodies do get served, not just refused
        # (which generated bodies get a 2xx depends on the workers' state at that moment: a generated body may
        # ask for n > 1 with a tool, a 400; so the served check is one plain body of this operation)
        r = httpx.post(fuzz_gateway.url + path, json=SERVED_CHECK[path], timeout=30)
        assert r.status_code == 200
        ANSWERS[path].model_validate(r.json())  # the answer is what /openapi.json says it is


def test_the_stack_is_healthy_after_the_fuzzing(fuzz_gateway):
    assert httpx.get(fuzz_gateway.url + "/ready").status_code == 200
    r = httpx.post(fuzz_gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert fuzz_gateway.gateway.pending.count == 0  # every admitted request was released


def test_openapi_document_describes_the_public_api(fuzz_gateway):
    doc = httpx.get(fuzz_gateway.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/v1/messages",
            "/tokenize"} <= set(doc["paths"])
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["model", "messages"] and chat["properties"]["temperature"]["maximum"] == 2
