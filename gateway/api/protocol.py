"""OpenAI request bodies -> one validated `ApiRequest`.

Both endpoints (`/v1/chat/completions`, `/v1/completions`) parse into the same dataclass, so the
generation path does not care which one it serves. The pydantic models of gateway/api/request_models.py
check every field alone (gateway/api/validation.py names a bad one); what is left here is what needs
several fields at once: top_logprobs needs logprobs, max_tokens 0 needs echo, one output
constraint at a time, tool choices naming listed tools (gateway/serving/tools.py), and a combination that
no engine kind serves. The other APIs (Responses, Messages) map onto a chat body and end here too.
`ApiRequest` itself, what the request path serves, is gateway/serving/api_request.py's.
"""

from __future__ import annotations

import json

from duet import contract as c
from duet.contract import PAGED_CAPABILITIES, PREFIX_CAPABILITIES, Capability
from gateway.api.extra_params import extra_sampling
from gateway.api.request_models import ChatCompletionRequest, CompletionRequest
from gateway.api.validation import refuse_unsupported, validate
from gateway.errors import InvalidRequest
from gateway.serving.api_request import ApiRequest, Sampling
from gateway.serving.tools import ToolRequest, parse_tools


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` map (keys and ranges checked by the model; ids against the
    vocabulary in prepare())."""
    return tuple(sorted((int(k), float(v)) for k, v in (raw or {}).items()))


def _response_format(rf) -> tuple[bool, str | None]:
    if rf is None or rf.type == "text":
        return False, None
    if rf.type == "json_object":
        return True, None
    return False, json.dumps(rf.json_schema.schema_)


def _sampling(req: ChatCompletionRequest | CompletionRequest) -> Sampling:
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs, top = bool(req.logprobs), req.top_logprobs or 0
        if top and not logprobs:
            raise InvalidRequest("top_logprobs: needs 'logprobs': true", "top_logprobs")
    else:
        max_tokens = req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens: 0 asks for no tokens, which only scores the prompt: it needs "
                                 "'echo': true", "max_tokens")
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    prompt_logprobs = req.prompt_logprobs
    if not chat and req.echo and logprobs and prompt_logprobs is None:
        prompt_logprobs = top  # OpenAI's legacy shape: echo with logprobs scores the prompt's tokens too
    json_object, json_schema = _response_format(req.response_format)
    n = req.n or c.N.default
    extra = extra_sampling(req, n)
    if extra.get("regex") is not None and (json_object or json_schema is not None):
        raise InvalidRequest("regex: give one of response_format (json) and regex/guided_choice, not both", "regex")
    stop = req.stop if req.stop is not None else ()
    return Sampling(
        max_tokens=max_tokens,
        temperature=_or(req.temperature, c.TEMPERATURE), top_p=_or(req.top_p, c.TOP_P),
        top_k=req.top_k or c.TOP_K.default,  # the API's 0 is "no cut" too
        min_p=_or(req.min_p, c.MIN_P), presence_penalty=_or(req.presence_penalty, c.PRESENCE_PENALTY),
        frequency_penalty=_or(req.frequency_penalty, c.FREQUENCY_PENALTY),
        repetition_penalty=_or(req.repetition_penalty, c.REPETITION_PENALTY), seed=req.seed, n=n,
        logprobs=logprobs, top_logprobs=top,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or c.MIN_TOKENS.default, json_object=json_object, json_schema=json_schema,
        logit_bias=_logit_bias(req.logit_bias), prompt_logprobs=prompt_logprobs, **extra,
    )


def _or(value: float | None, bound: c.Bound) -> float:
    return bound.default if value is None else float(value)


def chat_messages(messages: list) -> list[dict]:
    """Validated ChatMessages -> the dicts the chat template gets (text parts joined)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):  # content parts: only text parts carry meaning for a text model
            d["content"] = "".join(p.text for p in m.content)
        elif m.content is None:
            d["content"] = None
        out.append(d)
    return out


def chat_tools(req, messages: list[dict]) -> ToolRequest | None:
    tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
    choice = getattr(req, "tool_choice", None)
    return parse_tools(tools, choice.model_dump() if hasattr(choice, "model_dump") else choice, messages)


def _stream(req) -> tuple[bool, bool]:
    return bool(req.stream), bool(req.stream_options and req.stream_options.include_usage)


def parse_chat(body: object) -> ApiRequest:
    req = validate(ChatCompletionRequest, body)
    messages = chat_messages(req.messages)
    tools = chat_tools(req, messages)
    sampling = _sampling(req)
    if tools is not None and tools.constraint() is not None and (
            sampling.json_object or sampling.json_schema or sampling.regex is not None):
        raise InvalidRequest("tool_choice: 'required' or a named function cannot be combined with response_format "
                             "or regex/guided_choice", "tool_choice")
    stream, include_usage = _stream(req)
    return _servable(ApiRequest(
        kind="chat", model=req.model, sampling=sampling, messages=tuple(messages),
        tools=tools, stream=stream, include_usage=include_usage, user=req.user,
    ))


def parse_completions(body: object) -> list[ApiRequest]:
    """A completions body with one prompt or a batch: a list of strings or of token-id lists gives one
    ApiRequest per prompt (each served as its own engine call, choices numbered prompt * n + j)."""
    if isinstance(body, dict):
        refuse_unsupported(body, {"suffix": "this server does not do fill-in-the-middle completions"})
    req = validate(CompletionRequest, body)
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    sampling = _sampling(req)
    stream, include_usage = _stream(req)
    return [_servable(ApiRequest(
        kind="completion", model=req.model, sampling=sampling,
        prompt=p if isinstance(p, str) else tuple(p), stream=stream, include_usage=include_usage,
        user=req.user, echo=bool(req.echo))) for p in prompts]


def parse_completion(body: object) -> ApiRequest:
    """One prompt (a string, token ids, or a batch of one)."""
    apis = parse_completions(body)
    if len(apis) > 1:
        raise InvalidRequest("prompt: give one prompt here (a list of prompts is a batch)", "prompt")
    return apis[0]


# What only one engine kind does (gateway/routing/policy.py routes by the same split): a request that needs one
# of each can never be served, whatever the fleet's health, so it is the client's error, not a 503.
_PAGED_ONLY = {Capability.N: "n > 1", Capability.BEAM_SEARCH: "beam search"}
_PREFIX_ONLY = {Capability.STRUCTURED_OUTPUT: "response_format / regex / guided_choice / tools",
                Capability.SPECULATIVE: "speculative"}
assert set(_PAGED_ONLY) == PAGED_CAPABILITIES and set(_PREFIX_ONLY) == PREFIX_CAPABILITIES


def _servable(api: ApiRequest) -> ApiRequest:
    caps = api.required_capabilities
    paged = [v for k, v in _PAGED_ONLY.items() if k in caps]
    prefix = [v for k, v in _PREFIX_ONLY.items() if k in caps]
    if paged and prefix:
        raise InvalidRequest(f"{paged[0]} cannot be combined with {prefix[0]}: no engine kind does both")
    return api
