"""OpenAI request bodies -> one validated `ApiRequest`.

Both endpoints (`/v1/chat/completions`, `/v1/completions`) parse into the same dataclass, so the
generation path does not care which one it serves. Unknown fields are ignored (as OpenAI-compatible
servers do); a known field with a bad value raises `InvalidRequest` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.errors import InvalidRequest
from gateway.extra_params import extra_sampling
from gateway.tools import ToolRequest, parse_tools

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16
MAX_N = 64
MAX_TOKEN_ID = 1 << 31  # token ids travel as uint32; no vocabulary comes near this


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of either endpoint; `max_tokens` None means "fill the context"."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token; 0 with logprobs=True still returns the chosen token's
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    json_object: bool = False
    json_schema: str | None = None
    # vLLM's extra parameters (gateway/extra_params.py)
    beam_width: int = 1
    length_penalty: float = 1.0
    regex: str | None = None
    speculative: bool | None = None
    priority: int = 0  # lower is admitted first by an engine scheduling by priority
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); ids checked in prepare()
    prompt_logprobs: int | None = None  # alternatives per prompt token (echo + logprobs, or vLLM's field)


@dataclass(frozen=True)
class ApiRequest:
    kind: str  # "chat" | "completion"
    model: str
    sampling: Sampling
    messages: tuple[dict, ...] = ()
    tools: ToolRequest | None = None
    prompt: str | tuple[int, ...] = ""
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    echo: bool = False

    @property
    def turn_count(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "user") or 1

    @property
    def required_capabilities(self) -> frozenset[str]:
        s = self.sampling
        caps = set()
        if s.n > 1 and s.beam_width == 1:
            caps.add("n")
        if s.beam_width > 1:
            caps.add("beam_search")
        if s.json_object or s.json_schema is not None or s.regex is not None or (self.tools and self.tools.active):
            caps.add("structured_output")  # tool requests route like structured output
        if s.speculative:
            caps.add("speculative")
        return frozenset(caps)


def _num(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)  # 2.0 is an integer in JSON Schema (and to vLLM's pydantic models)
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        raise InvalidRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return tuple(stop)


MAX_LOGIT_BIAS_TOKENS = 1024


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` map; the ids are checked against the vocabulary in prepare()."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS_TOKENS} "
                             "{\"token id\": bias} entries", "logit_bias")
    out = {}
    for key, bias in raw.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 else None
        if token is None or token >= MAX_TOKEN_ID:
            raise InvalidRequest(f"'logit_bias' keys must be token ids (0 <= id < {MAX_TOKEN_ID}), got {key!r}",
                                 "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidRequest(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for {key}",
                                 "logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _response_format(body: dict) -> tuple[bool, str | None]:
    rf = body.get("response_format")
    if rf is None:
        return False, None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema (an object)",
                                 "response_format")
        return False, json.dumps(schema)
    raise InvalidRequest("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")


def _sampling(body: dict, chat: bool) -> Sampling:
    # a completion that echoes its prompt may ask for no new tokens: it scores the prompt
    # (lm-evaluation-harness's loglikelihood requests: echo, logprobs, max_tokens 0)
    scoring = not chat and body.get("echo") is True
    max_tokens = _num(body, "max_tokens", None, 0 if scoring else 1, 1 << 31, integer=True)
    if chat:
        max_tokens = _num(body, "max_completion_tokens", max_tokens, 1, 1 << 31, integer=True)
        logprobs = _flag(body, "logprobs")
        top = _num(body, "top_logprobs", 0, 0, 20, integer=True)
        if top and not logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        top = _num(body, "logprobs", None, 0, 20, integer=True)
        logprobs, top = top is not None, top or 0
    prompt_logprobs = _num(body, "prompt_logprobs", None, 0, 20, integer=True)
    if scoring and logprobs and prompt_logprobs is None:
        prompt_logprobs = top  # OpenAI's legacy shape: echo with logprobs scores the prompt's tokens too
    json_object, json_schema = _response_format(body)
    n = _num(body, "n", 1, 1, MAX_N, integer=True)
    extra = extra_sampling(body, n)
    if extra.get("regex") is not None and (json_object or json_schema is not None):
        raise InvalidRequest("give one of response_format (json) and regex/guided_choice, not both", "regex")
    stop_ids = body.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in stop_ids):
        raise InvalidRequest(f"'stop_token_ids' must be a list of token ids (0 <= id < {MAX_TOKEN_ID})",
                             "stop_token_ids")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(_num(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_num(body, "top_p", 1.0, 1e-9, 1.0)),
        top_k=_num(body, "top_k", None, 0, 1 << 20, integer=True) or None,
        min_p=float(_num(body, "min_p", 0.0, 0.0, 1.0)),
        presence_penalty=float(_num(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(_num(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        repetition_penalty=float(_num(body, "repetition_penalty", 1.0, 1e-3, 10.0)),
        seed=_num(body, "seed", None, -(1 << 63), (1 << 64) - 1, integer=True),
        n=n,
        logprobs=logprobs,
        top_logprobs=top,
        stop=_stop(body),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_flag(body, "ignore_eos"),
        min_tokens=_num(body, "min_tokens", 0, 0, 1 << 31, integer=True),
        json_object=json_object,
        json_schema=json_schema,
        logit_bias=_logit_bias(body),
        prompt_logprobs=prompt_logprobs,
        **extra,
    )


def _common(body: object) -> tuple[str, bool, bool, str | None]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required (a string)", "model")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", "user")
    return model, stream, include_usage, user


def _content_text(message: dict, i: int) -> dict:
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts carry meaning for a text model
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        message = {**message, "content": "".join(parts)}
    elif content is not None and not isinstance(content, str):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
    return message


def parse_chat(body: object) -> ApiRequest:
    model, stream, include_usage, user = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("role") not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}", "messages")
        parsed.append(_content_text(m, i))
    tools = parse_tools(body, parsed)
    sampling = _sampling(body, chat=True)
    if tools is not None and tools.constraint() is not None and (
            sampling.json_object or sampling.json_schema or sampling.regex is not None):
        raise InvalidRequest("tool_choice 'required' or a named function cannot be combined with response_format "
                             "or regex/guided_choice", "tool_choice")
    return _servable(ApiRequest(
        kind="chat", model=model, sampling=sampling, messages=tuple(parsed),
        tools=tools, stream=stream, include_usage=include_usage, user=user,
    ))


MAX_BATCH_PROMPTS = 256


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_completions(body: object) -> list[ApiRequest]:
    """A completions body with one prompt or a batch: a list of strings or of token-id lists gives one
    ApiRequest per prompt (each served as its own engine call, choices numbered prompt * n + j)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str) or _is_token_list(p) for p in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise InvalidRequest(f"'prompt' takes at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}", "prompt")
        return [parse_completion({**body, "prompt": p}) for p in prompt]
    return [parse_completion(body)]


def parse_completion(body: object) -> ApiRequest:
    """One prompt (a string, token ids, or a batch of one); parse_completions splits a batch first."""
    model, stream, include_usage, user = _common(body)
    if body.get("suffix") not in (None, ""):
        raise InvalidRequest("'suffix' is not supported: this server does not do fill-in-the-middle completions",
                             "suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID
                                 for t in prompt):
            raise InvalidRequest("'prompt' must be a string or a list of token ids (one prompt per request)",
                                 "prompt")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string or a list of token ids", "prompt")
    return _servable(ApiRequest(
        kind="completion", model=model, sampling=_sampling(body, chat=False), prompt=prompt, stream=stream,
        include_usage=include_usage, user=user, echo=_flag(body, "echo"),
    ))


# What only one engine kind does (gateway/routing.py routes by the same split): a request that needs one
# of each can never be served, whatever the fleet's health, so it is the client's error, not a 503.
_PAGED_ONLY = {"n": "n > 1", "beam_search": "beam search"}
_PREFIX_ONLY = {"structured_output": "response_format / regex / guided_choice / tools",
                "speculative": "speculative"}


def _servable(api: ApiRequest) -> ApiRequest:
    caps = api.required_capabilities
    paged = [v for k, v in _PAGED_ONLY.items() if k in caps]
    prefix = [v for k, v in _PREFIX_ONLY.items() if k in caps]
    if paged and prefix:
        raise InvalidRequest(f"{paged[0]} cannot be combined with {prefix[0]}: no engine kind does both")
    return api
