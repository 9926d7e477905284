"""The OpenAI completion endpoints: `POST /v1/chat/completions` and `POST /v1/completions`.

A request: parse the body (gateway/api/protocol.py) -> start it on the serving path (the in-flight cap,
prepare, admission control, per-key limits, dispatch: gateway/serving/start.py) -> render the run's events
(gateway/serving/chat_chunks.py) as an SSE stream or, once all are in, one JSON response; a completions batch
merges its prompts' runs (gateway/api/completion_batch.py). The client's
`timeout` (`client_timeout_s`) bounds all of it. Every error becomes an OpenAI error object through
gateway/errors.py.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import errors
from gateway.api import completion_batch as batch
from gateway.api.protocol import parse_chat, parse_completions
from gateway.body_parser import parse_json_body
from gateway.serving.chat_chunks import ChunkBuilder, stream
from gateway.serving.context import serving_context
from gateway.serving.runs import collect, disconnected
from gateway.serving.start import start
from gateway.serving.timeouts import client_timeout_s


async def chat_completions(request: Request) -> Response:
    return await _generate(request, lambda body: [parse_chat(body)])


async def completions(request: Request) -> Response:
    return await _generate(request, parse_completions)


async def _generate(request: Request, parse) -> Response:
    """`parse(body)` gives one ApiRequest per prompt; the answers are merged into one response."""
    ctx = serving_context(request)
    try:
        body = parse_json_body(await request.body())
        timeout_s = client_timeout_s(request.headers, body)
        apis = parse(body)
    except errors.GatewayError as e:
        ctx.metrics.requests.labels(request.url.path, str(e.status)).inc()
        return errors.error_response(e)
    try:
        runs, headers = await start(request, apis, timeout_s=timeout_s)
    except errors.GatewayError as e:
        return errors.error_response(e)
    if len(runs) > 1:
        if apis[0].stream:
            return StreamingResponse(batch.stream(runs), media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})
        return await batch.collect(runs, headers, disconnected(request))
    run = runs[0]
    builder = ChunkBuilder(run)
    if run.prep.api.stream:
        return StreamingResponse(stream(run, builder), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})

    async def whole(events: list) -> dict:
        return builder.whole(builder.choices(events[0]), run.usage)

    return await collect(runs, disconnected(request), headers, whole)
