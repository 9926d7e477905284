"""Route a prepared request and open its engine stream: `dispatch(ctx, prep) -> Dispatched`.

`Router.decide` (gateway.routing.policy.route unless the config names another policy) picks a worker; the
stream is opened and its first message awaited. A worker that fails before it is left out, the
failed attempt recorded in the request stats (ok=False, its variant), and the request re-routed (at
most `max_attempts` workers); a worker that refuses it for load (RESOURCE_EXHAUSTED, HTTP 429) is not a
failure, and the request is not re-routed: the client gets 429 + Retry-After, so an overloaded pool never
sees retries (flow control, gateway/serving/admission.py, keeps the queues short before that); the decision is recorded. When the only workers left are behind open
circuit breakers, it waits (once) for the first to turn half-open, if that comes before the client's
deadline, instead of failing at once.

The caller must `close()` the Dispatched it got, which cancels the gRPC call (client disconnect,
stop string hit): the engine aborts the request and frees its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace

from opentelemetry import trace

from duet.hashing import block_hashes
from duet.tracing import inject_metadata
from gateway import errors
from gateway.backends.engine_client import EngineCallError
from gateway.routing.route_types import NoCapableWorker, RouteRequest, RoutingConfig, UnknownVariant
from gateway.serving.context import ServingContext
from gateway.serving.generation import Dispatched, Prepared, to_pb
from gateway.serving.request_class import request_class
from gateway.serving.timeouts import ClientDeadline

_SEQUENCE = itertools.count()  # routed requests of this process (RouteRequest.sequence)


async def dispatch(ctx: ServingContext, prep: Prepared) -> Dispatched:
    """Route and open the stream, retrying on other workers until one answers (see module doc)."""
    tracer = ctx.tracer
    model_id = prep.model.model_id
    api = prep.api
    req = route_request(ctx, prep, next(_SEQUENCE))
    block_size = req.block_tokens
    config = await ctx.state.get_routing(model_id) or ctx.config.routing
    affinity_key = prep.session_key or None
    affinity = await ctx.state.get_affinity(affinity_key) if affinity_key else None
    message = to_pb(prep)
    excluded: set[str] = set()
    last_error: EngineCallError | None = None
    # one "route" span over routing and every attempt; each attempt's gRPC client span is its child
    # and lives as long as the stream (Dispatched.close ends it)
    waited_for_breaker = False
    with tracer.start_as_current_span("route") as route_span:
        attempt = 0
        while attempt < ctx.config.limits.max_attempts:
            attempt += 1
            views = [v for v in ctx.router.views() if v.worker_id not in excluded]
            t0 = time.perf_counter()
            try:
                decision = ctx.router.decide(req, views, config, affinity)
            except UnknownVariant as e:
                raise errors.UnknownVariantError(str(e), "x-duet-variant") from None
            except NoCapableWorker as e:
                wait = None if waited_for_breaker else _breaker_wait_s(ctx, req, config, excluded, prep.deadline)
                if wait is not None:  # every capable worker is behind an open breaker: wait for a probe
                    waited_for_breaker = True
                    attempt -= 1
                    await asyncio.sleep(wait)
                    continue
                detail = f" (last worker error: {last_error})" if last_error else ""
                raise errors.NoCapableWorkerError(f"{e}{detail}") from None
            ctx.metrics.route_seconds.observe(time.perf_counter() - t0)
            route_span.set_attributes({
                "duet.worker": decision.worker_id, "duet.engine": decision.engine_kind,
                "duet.variant": decision.variant, "duet.route_reason": decision.reason,
                "duet.estimated_reuse": decision.estimated_reuse, "duet.attempts": attempt})
            worker = ctx.fleet.get(decision.worker_id)
            if worker is None:  # left the fleet since the snapshot
                excluded.add(decision.worker_id)
                continue
            span = tracer.start_span("duet.engine.v1.Engine/Generate", kind=trace.SpanKind.CLIENT, attributes={
                "rpc.system": "grpc", "rpc.service": "duet.engine.v1.Engine", "rpc.method": "Generate",
                "server.address": worker.address, "duet.worker": decision.worker_id})
            stream = ctx.watchdog.watch(  # first-token and stall timeouts, circuit-breaker outcomes
                worker.client.generate(message, metadata=inject_metadata(trace.set_span_in_context(span))),
                decision.worker_id, prep.deadline)
            it = stream.__aiter__()
            # until its first message the request is queued prefill on that worker (routing's load signal)
            ctx.pool_tracker.prefill_started(prep.request_id, decision.worker_id, len(prep.prompt_ids) - min(
                decision.cached_blocks * block_size, len(prep.prompt_ids) - 1), prep.tenant)
            try:
                first = await it.__anext__()
                ctx.pool_tracker.first_token(prep.request_id)  # the prefill rate this gateway observes
            except (EngineCallError, StopAsyncIteration) as e:
                stream.cancel()
                if isinstance(e, ClientDeadline):
                    span.end()
                    raise errors.RequestTimeout(f"the request's timeout passed before its first token "
                                                f"({e.details})") from None
                if isinstance(e, EngineCallError) and not e.retryable:
                    span.end()
                    raise errors.InvalidRequest(f"the engine rejected the request: {e.details}") from None
                if isinstance(e, EngineCallError) and e.busy:  # never retried into a loaded pool
                    span.end()
                    raise errors.EngineBusy(f"worker {decision.worker_id} refused the request for load "
                                            f"({e.details}). Retry after 1 s.") from None
                last_error = e if isinstance(e, EngineCallError) else EngineCallError(
                    decision.worker_id, "EMPTY", "stream ended without output", True)
                span.record_exception(last_error)
                span.set_status(trace.StatusCode.ERROR, str(last_error))
                span.end()
                excluded.add(decision.worker_id)
                ctx.fleet.mark_failed(decision.worker_id)
                ctx.metrics.retries.labels(decision.worker_id).inc()
                # the client may still succeed on another worker, but this attempt failed: the canary
                # analysis must see it, or a variant that fails every first attempt looks healthy
                ctx.stats.record(model=model_id, ok=False, engine_kind=decision.engine_kind,
                                variant=decision.variant, worker_id=decision.worker_id, reason=decision.reason)
                affinity = None
                continue
            except BaseException:
                stream.cancel()
                span.end()
                raise
            finally:
                ctx.pool_tracker.prefill_done(prep.request_id)
            if api.stream:  # a stream's client times out between chunks, not on the whole answer
                stream.deadline = None
            ctx.router.record(prep.request_id, req, decision)
            if affinity_key:
                await ctx.state.set_affinity(affinity_key, decision.worker_id, ctx.config.affinity_ttl_s)
            return Dispatched(decision, stream, it, first, attempt, span, req.block_hashes)
    raise errors.EngineFailure(f"{ctx.config.limits.max_attempts} workers failed before the first token; "
                               f"last error: {last_error}")


def route_request(ctx: ServingContext, prep: Prepared, sequence: int = 0,
                  max_blocks: int | None = None) -> RouteRequest:
    """What routing reads of a prepared request: its prompt's chained block hashes (the first `max_blocks`,
    default the config's head), keys and capabilities. Admission asks the Router which workers could serve
    the same request, for which the canary's sticky key's leading blocks are enough."""
    model_id = prep.model.model_id
    block_size = ctx.router.block_size(model_id)
    hashes = tuple(block_hashes(prep.prompt_ids, block_size, model_id, prep.cache_salt,
                                max_blocks=max_blocks or ctx.config.max_hash_blocks))
    api = prep.api
    return RouteRequest(
        model=model_id, block_hashes=hashes, num_prompt_tokens=len(prep.prompt_ids),
        session_key=prep.session_key, user_key=api.user, required_capabilities=api.required_capabilities,
        variant_override=prep.variant_override, turn_count=api.turn_count, sequence=sequence,
        block_tokens=block_size, traffic_class=request_class(api, prep.session_key, len(prep.prompt_ids)),
    )


def _breaker_wait_s(ctx: ServingContext, req: RouteRequest, config: RoutingConfig, excluded: set[str],
                    deadline: float | None) -> float | None:
    """Seconds until the first open breaker among the workers that could serve `req` turns half-open;
    None when no such worker is held out by its breaker alone, or the wait would pass the deadline."""
    held_out = [replace(v, draining=v.draining or v.worker_id in ctx.fleet.drained)
                for v in ctx.fleet.views() if v.worker_id not in excluded]
    waits = [w for v in ctx.router.capable(req, held_out, config)
             if (w := ctx.breakers.reopens_in(v.worker_id)) is not None]
    if not waits:
        return None
    wait = min(waits) + 0.01  # just past the moment it turns half-open
    if deadline is not None and time.monotonic() + wait > deadline:
        return None
    return wait
