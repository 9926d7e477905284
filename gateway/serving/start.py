"""The request path's entry: `start(request, apis)` takes each `ApiRequest` through the steps below and
returns their runs. Every API starts here (gateway/api/completions.py, responses.py, messages.py).

    pending    count it in (429 when `max_pending_requests` are in flight: gateway/serving/pending.py)
    prepare    render and tokenize (gateway/serving/generation.py; a long prompt off the event loop)
    admit      admission control and flow control: refuse a request that would wait too long in an engine
               queue, by its priority band and its API key's share (429 + Retry-After,
               gateway/serving/admission.py)
    limits     the API key's limits (gateway/control/limits.py; LeaseMiddleware releases the lease)
    dispatch   route and open the engine stream (gateway/serving/dispatch.py)
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import replace

from starlette.requests import Request

from gateway import errors
from gateway.control.limits import STANDARD
from gateway.serving import admission
from gateway.serving.api_request import ApiRequest
from gateway.serving.context import ServingContext, serving_context
from gateway.serving.dispatch import dispatch
from gateway.serving.generation import Dispatched, Prepared, prepare
from gateway.serving.runs import Run

LONG_PROMPT_CHARS = 16_384


def _text_size(api: ApiRequest) -> int:
    if api.kind == "chat":
        return sum(len(m.get("content") or "") for m in api.messages)
    return len(api.prompt) if isinstance(api.prompt, str) else 0


def _variant_override(request: Request, ctx: ServingContext) -> str | None:
    """`x-duet-variant` pins a canary arm: an operator tool, so it needs the admin key when one is set."""
    variant = request.headers.get("x-duet-variant")
    admin_key = ctx.config.admin_key
    if not variant or admin_key is None:
        return variant or None
    given = request.headers.get("x-duet-admin-key", "")
    return variant if hmac.compare_digest(given.encode(), admin_key.encode()) else None


async def _prepare(request: Request, ctx: ServingContext, api: ApiRequest,
                   session_key: str | None) -> Prepared:
    model = ctx.models.get(api.model)
    if model is None:
        raise errors.ModelNotFound(api.model)
    args = (api, model, request.state.request_id, request.state.cache_salt,
            session_key or request.headers.get("x-session-id"), _variant_override(request, ctx),
            ctx.config.limits.default_max_tokens)
    # a long prompt tokenizes off the event loop (the tokenizer releases the GIL), so it does not
    # stall every other stream's tokens
    return await asyncio.to_thread(prepare, *args) if _text_size(api) > LONG_PROMPT_CHARS else prepare(*args)


async def start(request: Request, apis: list[ApiRequest], session_key: str | None = None,
                timeout_s: float | None = None) -> tuple[list[Run], dict]:
    """Prepare, admit and dispatch each ApiRequest (one per prompt; a completions batch has several):
    the runs, and the routing headers of the first. Raises GatewayError with nothing left held (and the
    failure counted).
    `session_key` (a conversation's id) overrides the x-session-id header for affinity; `timeout_s` (the
    client's own timeout, gateway.serving.timeouts.client_timeout_s) bounds the wait and ends the request."""
    ctx = serving_context(request)
    endpoint = request.url.path
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    claimed = 0
    dispatched: list[Dispatched] = []
    try:
        for api in apis:
            if api.model not in ctx.models:
                raise errors.ModelNotFound(api.model)
        key_id = getattr(request.state, "api_key_id", None)
        key_limits = ctx.config.key_limits.get(key_id) if key_id else None
        band = admission.request_band(key_limits.band if key_limits else STANDARD,
                                      request.headers.get(admission.BAND_HEADER))
        for _ in apis:
            ctx.pending.claim()
            claimed += 1
        preps = [await _prepare(request, ctx, api, session_key) for api in apis]
        if len(preps) > 1:  # one id per choice set: each engine call needs its own request id
            preps = [replace(p, request_id=f"{p.request_id}-{i}") for i, p in enumerate(preps)]
        preps = [replace(p, deadline=deadline, tenant=key_id) for p in preps]
        for p in preps:  # a wait past its band's bound (or the client's timeout) is a 429 before any work
            await admission.admit(ctx, p, None if deadline is None else deadline - time.monotonic(), band)
        request.state.key_lease = await ctx.limiter.acquire(  # per-key limits; LeaseMiddleware releases it
            key_id, apis[0].model,
            sum(len(p.prompt_ids) + p.max_tokens * p.api.sampling.n for p in preps))
        results = await asyncio.gather(*(dispatch(ctx, p) for p in preps), return_exceptions=True)
        dispatched = [r for r in results if isinstance(r, Dispatched)]
        failed = next((r for r in results if not isinstance(r, Dispatched)), None)
        if failed is not None:
            raise failed
    except errors.GatewayError as e:
        for d in dispatched:
            d.close()
        for _ in range(claimed):
            ctx.pending.release()
        ctx.metrics.requests.labels(endpoint, str(e.status)).inc()
        ctx.stats.record(model=apis[0].model, ok=False)
        raise
    except BaseException:
        for d in dispatched:
            d.close()
        for _ in range(claimed):
            ctx.pending.release()
        raise
    dec = dispatched[0].decision
    headers = {"x-duet-engine": dec.engine_kind, "x-duet-worker": dec.worker_id, "x-duet-variant": dec.variant,
               "x-duet-route-reason": dec.reason}
    runs = [Run(ctx, p, d, endpoint, tap=ctx.mirror.tap(p, d.decision)) for p, d in zip(preps, dispatched)]
    return runs, headers
