"""Admission control: a request that would wait too long in an engine's queue is refused at once.

Refusing up front (429 + Retry-After, before routing, before any engine sees the request) beats
queueing a request that times out later, after an engine spent prefill on it. The estimate per
worker that can serve the request (the Router's `capable`: serving the model, healthy, not draining, with
the capabilities the request needs, in its canary arm):

    wait_s = queued prefill tokens / prefill rate

Queued prefill tokens are this gateway's own count (gateway/control/pool_tracker.py: the uncached prompt
tokens of requests sent to the worker that have not produced their first token yet); the prefill
rate is the worker's own measurement over its recent steps, decode sharing them included
(GetLoad `prefill_tokens_per_s`, engine_core/step_rates.py). The request's wait is the best
candidate's (routing may pick a busier one for its cache; that wait is the one it chose). A worker
that has not measured a rate yet, with prefill queued, has no estimate: the request is admitted.

The bound is `limits.max_queue_wait_s`, lowered for one request by its client's `timeout` (a
request its client will abandon before it starts is not worth starting). Retry-After says when the
queue should have drained below the bound: the excess wait, rounded up, at least one second.
`admit` is the request path's call (gateway/serving/start.py, after tokenizing, before per-key limits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.errors import QueueWaitTooLong
from gateway.routing.canary import STICKY_BLOCKS
from gateway.routing.policy import capable
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from gateway.serving.context import ServingContext
from gateway.serving.dispatch import route_request
from gateway.serving.generation import Prepared


@dataclass(frozen=True)
class WaitEstimate:
    worker_id: str
    wait_s: float


def queue_wait_s(queued_prefill_tokens: int, prefill_tokens_per_s: float) -> float | None:
    """Seconds before a new request on this worker starts its prefill; None when it cannot be told."""
    if queued_prefill_tokens <= 0:
        return 0.0
    if prefill_tokens_per_s <= 0:
        return None
    return queued_prefill_tokens / prefill_tokens_per_s


def best_wait(candidates: Iterable[tuple[WorkerView, float]], model_id: str,
              required_capabilities: frozenset[str] = frozenset(), *, request: RouteRequest | None = None,
              config: RoutingConfig | None = None) -> WaitEstimate | None:
    """The shortest estimated wait among (view, prefill rate) pairs able to serve the request (`request`,
    or one of `model_id` needing `required_capabilities`; `config` names the canary arms);
    None when there is no candidate or one of them has no estimate (admitted: routing decides)."""
    candidates = list(candidates)
    req = request or RouteRequest(model=model_id, block_hashes=(), num_prompt_tokens=0,
                                  required_capabilities=required_capabilities)
    able = {v.worker_id for v in capable(req, [v for v, _ in candidates], config or RoutingConfig())}
    best: WaitEstimate | None = None
    for view, rate in candidates:
        if view.worker_id not in able:
            continue
        wait = queue_wait_s(view.queued_prefill_tokens, rate)
        if wait is None:
            return None
        if best is None or wait < best.wait_s:
            best = WaitEstimate(view.worker_id, wait)
    return best


def check_wait(estimate: WaitEstimate | None, max_queue_wait_s: float | None, client_timeout_s: float | None) -> None:
    """Raise QueueWaitTooLong when the estimated wait is over the bound (module doc)."""
    bounds = [b for b in (max_queue_wait_s, client_timeout_s) if b is not None]
    if estimate is None or not bounds:
        return
    bound = min(bounds)
    if estimate.wait_s <= bound:
        return
    retry = max(1, math.ceil(estimate.wait_s - bound))
    which = "the client's timeout" if client_timeout_s is not None and bound == client_timeout_s \
        else "max_queue_wait_s"
    raise QueueWaitTooLong(
        f"The engines are busy: this request would wait about {estimate.wait_s:.0f} s before it starts "
        f"(on worker {estimate.worker_id}, the least busy), over {which} of {bound:g} s. "
        f"Retry after {retry} s.", retry)


async def admit(ctx: ServingContext, prep: Prepared, client_timeout_s: float | None) -> None:
    """Check one prepared request against the gateway's workers now."""
    if ctx.config.limits.max_queue_wait_s is None and client_timeout_s is None:
        return  # no bound: nothing to estimate
    candidates = []
    for view in ctx.router.views():
        worker = ctx.fleet.get(view.worker_id)
        candidates.append((view, worker.load.prefill_tokens_per_s if worker and worker.load else 0.0))
    model_id = prep.model.model_id
    config = await ctx.state.get_routing(model_id) or ctx.config.routing
    estimate = best_wait(candidates, model_id, request=route_request(ctx, prep, max_blocks=STICKY_BLOCKS),
                         config=config)
    try:
        check_wait(estimate, ctx.config.limits.max_queue_wait_s, client_timeout_s)
    except QueueWaitTooLong:
        ctx.metrics.admission_refused.labels(prep.model.model_id).inc()
        raise
