"""HTTP endpoints: the OpenAI API (`/v1/...`), `/health`, `/ready`, `/metrics`.

A generation request: parse -> admit (429 when full) -> prepare (tokenize, 400 on context length)
-> admission control (429 + Retry-After when the engines could not start it in time,
gateway/serving/admission.py) -> per-key limits -> dispatch (route, retry before the first token) -> stream
SSE or collect one JSON response. The client's `timeout` (`client_timeout_s`) bounds all of it.
Every error becomes an OpenAI error object through gateway/errors.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import completion_batch as batch
from gateway import errors
from gateway.body_parser import parse_json_body
from gateway.metrics import CONTENT_TYPE
from gateway.protocol import parse_chat, parse_completions
from gateway.serving import admission
from gateway.serving.dispatch import dispatch
from gateway.serving.generation import Dispatched, Prepared, prepare
from gateway.serving.runs import Run, disconnected
from gateway.serving.timeouts import client_timeout_s
from gateway.tokenize_api import model_card

log = logging.getLogger("duet.gateway.api")

LONG_PROMPT_CHARS = 16_384


def _text_size(api) -> int:
    if api.kind == "chat":
        return sum(len(m.get("content") or "") for m in api.messages)
    return len(api.prompt) if isinstance(api.prompt, str) else 0


async def chat_completions(request: Request) -> Response:
    return await _generate(request, lambda body: [parse_chat(body)])


async def completions(request: Request) -> Response:
    return await _generate(request, parse_completions)


def _variant_override(request: Request, gw) -> str | None:
    """`x-duet-variant` pins a canary arm: an operator tool, so it needs the admin key when one is set."""
    variant = request.headers.get("x-duet-variant")
    if not variant or gw.admin_key is None:
        return variant or None
    given = request.headers.get("x-duet-admin-key", "")
    return variant if hmac.compare_digest(given.encode(), gw.admin_key.encode()) else None


async def _prepare(request: Request, gw, api, session_key: str | None) -> Prepared:
    model = gw.models.get(api.model)
    if model is None:
        raise errors.ModelNotFound(api.model)
    args = (api, model, request.state.request_id, request.state.cache_salt,
            session_key or request.headers.get("x-session-id"), _variant_override(request, gw),
            gw.config.limits.default_max_tokens)
    # a long prompt tokenizes off the event loop (the tokenizer releases the GIL), so it does not
    # stall every other stream's tokens
    return await asyncio.to_thread(prepare, *args) if _text_size(api) > LONG_PROMPT_CHARS else prepare(*args)


async def start(request: Request, apis: list, session_key: str | None = None,
                timeout_s: float | None = None) -> tuple[list[Run], dict]:
    """Admit, prepare and dispatch each ApiRequest (one per prompt; a completions batch has several):
    the runs, and the routing headers of the first. Raises GatewayError with nothing left held (and the
    failure counted); the other APIs (gateway/responses_api.py, messages_api.py) start here too.
    `session_key` (a conversation's id) overrides the x-session-id header for affinity; `timeout_s` (the
    client's own timeout, gateway.serving.timeouts.client_timeout_s) bounds the wait and ends the request."""
    gw = request.app.state.gateway
    endpoint = request.url.path
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    admitted = 0
    dispatched: list[Dispatched] = []
    try:
        for api in apis:
            if api.model not in gw.models:
                raise errors.ModelNotFound(api.model)
        for _ in apis:
            gw.admit()
            admitted += 1
        preps = [await _prepare(request, gw, api, session_key) for api in apis]
        if len(preps) > 1:  # one id per choice set: each engine call needs its own request id
            preps = [replace(p, request_id=f"{p.request_id}-{i}") for i, p in enumerate(preps)]
        if deadline is not None:
            preps = [replace(p, deadline=deadline) for p in preps]
        for p in preps:  # a wait past max_queue_wait_s (or the client's timeout) is a 429 before any work
            admission.admit_request(gw, p, None if deadline is None else deadline - time.monotonic())
        request.state.key_lease = await gw.limiter.admit(  # per-key limits; LeaseMiddleware releases it
            getattr(request.state, "api_key_id", None), apis[0].model,
            sum(len(p.prompt_ids) + p.max_tokens * p.api.sampling.n for p in preps))
        results = await asyncio.gather(*(dispatch(gw, p) for p in preps), return_exceptions=True)
        dispatched = [r for r in results if isinstance(r, Dispatched)]
        failed = next((r for r in results if not isinstance(r, Dispatched)), None)
        if failed is not None:
            raise failed
    except errors.GatewayError as e:
        for d in dispatched:
            d.close()
        for _ in range(admitted):
            gw.release()
        gw.metrics.requests.labels(endpoint, str(e.status)).inc()
        gw.stats.record(model=apis[0].model, ok=False)
        raise
    except BaseException:
        for d in dispatched:
            d.close()
        for _ in range(admitted):
            gw.release()
        raise
    dec = dispatched[0].decision
    headers = {"x-duet-engine": dec.engine_kind, "x-duet-worker": dec.worker_id, "x-duet-variant": dec.variant,
               "x-duet-route-reason": dec.reason}
    n = apis[0].sampling.n
    return [Run(gw, p, d, endpoint, index_offset=i * n) for i, (p, d) in enumerate(zip(preps, dispatched))], headers


async def _generate(request: Request, parse) -> Response:
    """`parse(body)` gives one ApiRequest per prompt; the answers are merged into one response."""
    gw = request.app.state.gateway
    try:
        body = parse_json_body(await request.body())
        timeout_s = client_timeout_s(request.headers, body)
        apis = parse(body)
    except errors.GatewayError as e:
        gw.metrics.requests.labels(request.url.path, str(e.status)).inc()
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
    if run.prep.api.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})
    return await run.collect(request, headers)


async def list_models(request: Request) -> Response:
    gw = request.app.state.gateway
    data = [model_card(m) for m in gw.models.values()]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 when every served model has at least one healthy, non-draining worker."""
    gw = request.app.state.gateway
    views = gw.views() if gw.pool else []
    per_model = {m: sum(1 for v in views if v.model_id == m and v.healthy and not v.draining) for m in gw.models}
    ok = bool(per_model) and all(per_model.values())
    return JSONResponse({"ready": ok, "healthy_workers": per_model}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    return Response(request.app.state.gateway.metrics.render(), media_type=CONTENT_TYPE)
