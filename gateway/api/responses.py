"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes a chat request (gateway/api/responses_input.py) and runs on the serving path (routing,
tools, structured output, streaming); the run's typed events (gateway/serving/events.py) render as a
Response object: a `message` item with `output_text`, and a `function_call` item per tool call.
Streaming sends the Responses events:

    response.created, response.in_progress,
    per item: response.output_item.added, then for a message response.content_part.added,
      response.output_text.delta ..., response.output_text.done, response.content_part.done,
      for a function call response.function_call_arguments.delta ..., .done;
      response.output_item.done,
    response.completed (or an `error` event when the engine fails mid-stream).

Stored responses (`store`, true by default) go to the StateStore (Redis with a TTL when the gateway
has Redis, so any replica continues a conversation) with the conversation so far. A request with
`previous_response_id` continues that conversation, and routes with the conversation's first
response id as its session key, so every turn goes to the worker that holds the conversation's KV.
Errors are OpenAI error objects; an unknown previous_response_id is a 404 before any work starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import errors
from gateway.api.protocol import parse_chat
from gateway.api.responses_input import Responses, to_chat, validate_responses
from gateway.body_parser import parse_json_body
from gateway.control.state import StateUnavailable
from gateway.serving.context import ServingContext, serving_context
from gateway.serving.events import Arguments, CallStart, Content, Finish, ToolCall, Usage, answer
from gateway.serving.runs import collect, disconnected
from gateway.serving.start import start
from gateway.serving.timeouts import client_timeout_s

log = logging.getLogger("duet.gateway.responses")

KIND = "response"
STORE_TTL_S = 7 * 24 * 3600.0


def _usage(usage: Usage) -> dict:
    p, c = usage.prompt_tokens, usage.completion_tokens
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


class _Reply:
    """One response being made: its id, the options it repeats, and what it becomes when done."""

    def __init__(self, ctx: ServingContext, rr: Responses, request_id: str, model: str, conversation_id: str) -> None:
        self.ctx, self.rr, self.model, self.conversation_id = ctx, rr, model, conversation_id
        self.id = "resp_" + request_id
        self.message_id = "msg_" + request_id
        self.created_at = int(time.time())

    def obj(self, status: str, output: list[dict], usage: Usage | None, finish: str | None = None) -> dict:
        incomplete = status == "completed" and finish == "length"
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete else status, "model": self.model, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
                "store": self.rr.store, "usage": _usage(usage) if usage is not None else None, **self.rr.echo}

    async def finish(self, text: str, calls: list[ToolCall], usage: Usage, finish: str | None) -> dict:
        output = ([_message_item(self.message_id, text)] if text or not calls else []) + [_call_item(c) for c in calls]
        obj = self.obj("completed", output, usage, finish)
        if self.rr.store:
            turn = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            doc = {"response": obj, "conversation": [*self.rr.conversation, turn],
                   "conversation_id": self.conversation_id}
            try:
                await self.ctx.state.put_document(KIND, self.id, doc, STORE_TTL_S)
            except StateUnavailable as e:  # the answer stands; only its continuation is lost
                log.warning("response %s not stored: %s", self.id, e)
                obj["store"] = False
        return obj


async def create(request: Request) -> Response:
    ctx = serving_context(request)
    try:
        body = parse_json_body(await request.body())
        req = validate_responses(body)
        previous = None
        if req.previous_response_id is not None:
            previous = await ctx.state.get_document(KIND, req.previous_response_id)
            if previous is None:
                raise errors.ResponseNotFound(req.previous_response_id, "previous_response_id")
        rr = to_chat(req, previous, body)
        try:
            api = parse_chat(rr.chat_body)
        except errors.InvalidRequest as e:
            e.param = "input" if e.param == "messages" else e.param
            raise
        reply = _Reply(ctx, rr, request.state.request_id, api.model,
                       previous["conversation_id"] if previous else "resp_" + request.state.request_id)
        runs, headers = await start(request, [api], session_key=reply.conversation_id,
                                    timeout_s=client_timeout_s(request.headers, None))
    except StateUnavailable as e:
        return errors.error_response(errors.StateStoreUnavailable(str(e)))
    except errors.GatewayError as e:
        return errors.error_response(e)
    if rr.stream:
        return StreamingResponse(_events(runs[0], reply), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})

    async def whole(events: list) -> dict:
        a = answer(events[0])
        return await reply.finish(a.text, list(a.calls), a.finish.usage, a.finish.reason)

    return await collect(runs, disconnected(request), headers, whole)


def _event(kind: str, seq: list[int], **fields) -> bytes:
    seq[0] += 1
    data = json.dumps({"type": kind, "sequence_number": seq[0], **fields}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _events(run, reply: _Reply):
    """The Responses event stream, rendered from the run's events (see the module doc)."""
    seq = [-1]
    yield (_event("response.created", seq, response=reply.obj("in_progress", [], None))
           + _event("response.in_progress", seq, response=reply.obj("in_progress", [], None)))
    text: list[str] = []
    calls: list[ToolCall] = []
    open_item: str | None = None  # "message" | "call"
    finish, usage = None, run.usage
    out: list[bytes] = []

    def open_message() -> list[bytes]:
        ids = {"item_id": reply.message_id, "output_index": 0}
        return [_event("response.output_item.added", seq, output_index=0,
                       item=_message_item(reply.message_id, "", "in_progress")),
                _event("response.content_part.added", seq, **ids, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})]

    def close_open() -> None:
        nonlocal open_item
        index = _index(text, calls)
        if open_item == "message":
            whole = "".join(text)
            part = {"type": "output_text", "text": whole, "annotations": []}
            ids = {"item_id": reply.message_id, "output_index": 0}
            out.append(_event("response.output_text.done", seq, **ids, content_index=0, text=whole, logprobs=[]))
            out.append(_event("response.content_part.done", seq, **ids, content_index=0, part=part))
            out.append(_event("response.output_item.done", seq, output_index=0,
                              item=_message_item(reply.message_id, whole)))
        elif open_item == "call":
            c = calls[-1]
            out.append(_event("response.function_call_arguments.done", seq, item_id="fc_" + c.id,
                              output_index=index, name=c.name, arguments=c.arguments))
            out.append(_event("response.output_item.done", seq, output_index=index, item=_call_item(c)))
        open_item = None

    try:
        async with contextlib.aclosing(run.events()) as steps:
            async for step in steps:
                for e in step:
                    if isinstance(e, Content) and e.text:
                        if open_item is None and not calls:
                            open_item = "message"
                            out.extend(open_message())
                        if open_item == "message":
                            text.append(e.text)
                            out.append(_event("response.output_text.delta", seq, item_id=reply.message_id,
                                              output_index=0, content_index=0, delta=e.text, logprobs=[]))
                    elif isinstance(e, CallStart):
                        close_open()
                        calls.append(ToolCall(e.id, e.name, ""))
                        open_item = "call"
                        out.append(_event("response.output_item.added", seq, output_index=_index(text, calls),
                                          item=_call_item(calls[-1], "in_progress")))
                    elif isinstance(e, Arguments):
                        calls[-1] = replace(calls[-1], arguments=calls[-1].arguments + e.text)
                        out.append(_event("response.function_call_arguments.delta", seq,
                                          item_id="fc_" + calls[-1].id, output_index=_index(text, calls),
                                          delta=e.text))
                    elif isinstance(e, Finish):
                        finish, usage = e.reason, e.usage
                if out:
                    yield b"".join(out)
                    out = []
    except errors.GatewayError as e:
        yield _event("error", seq, code=e.code or e.type, message=e.message, param=e.param)
        return
    if open_item is None and not calls and not text:  # nothing was said: an empty message, as finish() makes
        out.extend(open_message())
        open_item = "message"
    close_open()
    final = await reply.finish("".join(text), calls, usage, finish)
    out.append(_event("response.completed", seq, response=final))
    yield b"".join(out)


def _index(text: list[str], calls: list[ToolCall]) -> int:
    """The output index of the last call: after the message item when there is text."""
    return len(calls) - 1 + (1 if text else 0)


async def _stored(request: Request, op) -> tuple[str, object]:
    """`op(state, response_id)` on the stored response the path names; raises GatewayError (503, 404)."""
    response_id = request.path_params["response_id"]
    try:
        found = await op(serving_context(request).state, response_id)
    except StateUnavailable as e:
        raise errors.StateStoreUnavailable(str(e)) from None
    if not found:
        raise errors.ResponseNotFound(response_id)
    return response_id, found


async def retrieve(request: Request) -> Response:
    try:
        _, doc = await _stored(request, lambda state, rid: state.get_document(KIND, rid))
    except errors.GatewayError as e:
        return errors.error_response(e)
    return JSONResponse(doc["response"])


async def delete(request: Request) -> Response:
    try:
        response_id, _ = await _stored(request, lambda state, rid: state.delete_document(KIND, rid))
    except errors.GatewayError as e:
        return errors.error_response(e)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
