"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request becomes a chat request (gateway/api/messages_input.py) and runs on the serving path; the run's
typed events (gateway/serving/events.py) render as a Message: `text` and `tool_use` content blocks,
`stop_reason` (end_turn, max_tokens, stop_sequence with the `stop_sequence` that matched, tool_use), and
usage with `cache_read_input_tokens` (prompt tokens served from the prefix cache; `input_tokens` counts the
rest, as Anthropic counts them). Streaming sends Anthropic's events: message_start, per block
content_block_start / content_block_delta (text_delta, input_json_delta) / content_block_stop, then
message_delta (stop_reason, usage) and message_stop; a failure mid-stream is an `error` event.

Every error, here and in the middleware in front (a missing key, a body too large), has Anthropic's
shape `{"type": "error", "error": {"type", "message"}}`; `x-api-key` is accepted like a Bearer key.
"""

from __future__ import annotations

import contextlib
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from duet.tokenizer import ChatTemplateError, TokenizerError
from gateway import errors
from gateway.api.messages_input import CountTokensRequest, MessagesRequest, parse_messages
from gateway.api.protocol import parse_chat
from gateway.body_parser import parse_json_body
from gateway.serving.context import serving_context
from gateway.serving.events import Arguments, CallStart, Content, Finish, ToolCall, Usage, answer
from gateway.serving.runs import collect, disconnected
from gateway.serving.start import start
from gateway.serving.timeouts import client_timeout_s
from gateway.serving.tools import render_chat

_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return _STOP.get(finish, "end_turn")


def _usage(usage: Usage) -> dict:
    cached = usage.cached_tokens
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:  # "auto" parses what the model said; keep it visible rather than drop it
        arguments = {"_unparsed": call.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def parse_request(body: object, model: type[CountTokensRequest] = MessagesRequest):
    """The validated chat request of a Messages (or count_tokens) body (InvalidRequest naming the field)."""
    return parse_chat(parse_messages(body, model))


async def create(request: Request) -> Response:
    try:
        api = parse_request(parse_json_body(await request.body()))
        # the SDK's timeout header bounds the wait (a body `timeout` is not a Messages field)
        runs, headers = await start(request, [api], timeout_s=client_timeout_s(request.headers, None))
    except errors.GatewayError as e:
        return errors.anthropic_response(e)
    message_id = "msg_" + request.state.request_id
    if api.stream:
        return StreamingResponse(_events(runs[0], message_id, api.model), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})

    async def whole(events: list) -> dict:
        a = answer(events[0])
        content = [{"type": "text", "text": a.text}] if a.text else []
        content += [_tool_use(c) for c in a.calls]
        stop_sequence = a.finish.stop_sequence
        return {"id": message_id, "type": "message", "role": "assistant", "model": api.model, "content": content,
                "stop_reason": _stop_reason(a.finish.reason, stop_sequence), "stop_sequence": stop_sequence,
                "usage": _usage(a.finish.usage)}

    return await collect(runs, disconnected(request), headers, whole, errors.anthropic_response)


def _event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n".encode()


async def _events(run, message_id: str, model: str):
    """Anthropic's event stream, rendered from the run's events (see the module doc)."""
    block = -1  # index of the open content block
    kind = None  # "text" | "tool_use"
    finish, stop_sequence = None, None
    out: list[bytes] = []

    def open_block(content_block: dict) -> None:
        nonlocal block, kind
        close_block()
        block += 1
        kind = content_block["type"]
        out.append(_event("content_block_start", index=block, content_block=content_block))

    def close_block() -> None:
        nonlocal kind
        if kind is not None:
            out.append(_event("content_block_stop", index=block))
            kind = None

    usage = run.usage  # the prompt's so far (the engine's first message says how much of it was cached)
    out.append(_event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(usage)}))
    try:
        async with contextlib.aclosing(run.events()) as steps:
            async for step in steps:
                for e in step:
                    if isinstance(e, Content) and e.text:
                        if kind != "text":
                            open_block({"type": "text", "text": ""})
                        out.append(_event("content_block_delta", index=block,
                                          delta={"type": "text_delta", "text": e.text}))
                    elif isinstance(e, CallStart):
                        open_block({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                    elif isinstance(e, Arguments):
                        out.append(_event("content_block_delta", index=block, delta={
                            "type": "input_json_delta", "partial_json": e.text}))
                    elif isinstance(e, Finish):
                        finish, stop_sequence, usage = e.reason, e.stop_sequence, e.usage
                if out:
                    yield b"".join(out)
                    out = []
    except errors.GatewayError as e:
        yield _event("error", error=errors.anthropic_payload(e)["error"])
        return
    close_block()
    out.append(_event("message_delta", delta={"stop_reason": _stop_reason(finish, stop_sequence),
                                              "stop_sequence": stop_sequence},
                      usage={"output_tokens": usage.completion_tokens}))
    out.append(_event("message_stop"))
    yield b"".join(out)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as /v1/messages would bill them (the chat template with the tools rendered)."""
    ctx = serving_context(request)
    try:
        api = parse_request(parse_json_body(await request.body()), CountTokensRequest)
        model = ctx.models.get(api.model)
        if model is None:
            raise errors.ModelNotFound(api.model)
        tok = model.tokenizer
        messages, tools = render_chat(list(api.messages), api.tools, tok.template_takes_tools)
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools))
    except (ChatTemplateError, TokenizerError) as e:
        return errors.anthropic_response(errors.InvalidRequest(f"messages rejected by the chat template: {e}",
                                                               "messages"))
    except errors.GatewayError as e:
        return errors.anthropic_response(e)
    return JSONResponse({"input_tokens": len(ids)})
