"""Admission control: a request that would wait too long in an engine's queue is refused at once.

Refusing up front (429 + Retry-After, before routing, before any engine sees the request) beats
queueing a request that times out later, after an engine spent prefill on it. The estimate per
worker that can serve the request (the Router's `capable`: serving the model, healthy, not draining, with
the capabilities the request needs, in its canary arm):

    wait_s = queued prefill tokens / prefill rate

Queued prefill tokens are this gateway's own count (gateway/control/pool_tracker.py: the uncached prompt
tokens of requests sent to the worker that have not produced their first token yet); the prefill
rate is the worker's own measurement over its recent steps, decode sharing them included
(GetLoad `prefill_tokens_per_s`, engine_core/step_rates.py; a vLLM backend's from its /metrics counters,
gateway/backends/backend_load.py). The request's wait is the best
candidate's (routing may pick a busier one for its cache; that wait is the one it chose). A worker
that has not measured a rate yet, with prefill queued, has no estimate: the request is admitted.

The bound is `limits.max_queue_wait_s`, lowered for one request by its client's `timeout` (a
request its client will abandon before it starts is not worth starting). Retry-After says when the
queue should have drained below the bound: the excess wait, rounded up, at least one second.
`admit` is the request path's call (gateway/serving/start.py, after tokenizing, before per-key limits).

Flow control (issue 45) shapes that refusal by who asks and how much it matters, as llm-d's and the Gateway
API Inference Extension's flow control do by a fairness id and a priority band. They hold requests in a
queue at the gateway; Duet refuses at once instead (the client's backoff is the retry, and no gateway
replica holds work another could serve), so the engines' queue stays bounded and the choice is only whom to
refuse first:

    critical    never refused for the queue's length (only by its client's timeout): what must run
    standard    refused past `max_queue_wait_s`, unless its tenant (API key) holds less than an equal
                share of that bound: the bound over the tenants with prefill queued on the request's
                capable workers, this one included. A light tenant is admitted while a heavy one fills
                the queue; the heavy one is refused once its own queue passes its share.
    sheddable   refused once the wait passes half of `max_queue_wait_s`: the first work to go

A tenant's own wait is its queued prefill tokens on the capable workers over their summed prefill rate
(pool_tracker counts each request's tokens under its API key until its first token). The band is the
key's (`auth.api_keys[].band`, default standard); a request may lower it (`x-duet-band: sheddable`), never
raise it. A request over its client's timeout is refused whatever its band. Every refusal is the same 429
`queue_wait_exceeded` with Retry-After (the excess wait, rounded up, at least one second), counted in
`duet_admission_refused_total{model, band}`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.control.limits import BANDS, CRITICAL, SHEDDABLE, STANDARD
from gateway.errors import InvalidRequest, QueueWaitTooLong
from gateway.routing.canary import STICKY_BLOCKS
from gateway.routing.policy import capable
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from gateway.serving.context import ServingContext
from gateway.serving.dispatch import route_request
from gateway.serving.generation import Prepared

SHEDDABLE_SHARE = 0.5  # sheddable work is refused once the wait passes this part of max_queue_wait_s
BAND_HEADER = "x-duet-band"


@dataclass(frozen=True)
class WaitEstimate:
    worker_id: str
    wait_s: float


@dataclass(frozen=True)
class TenantShare:
    """The asking tenant's part of the queue on the request's capable workers."""

    wait_s: float  # its queued prefill tokens there over their summed prefill rate
    tenants: int  # tenants with prefill queued there, the asking one included


def request_band(key_band: str, header: str | None) -> str:
    """The band a request runs in: its key's, or a lower one it asks for (`x-duet-band`); never higher."""
    if not header:
        return key_band
    asked = header.strip().lower()
    if asked not in BANDS:
        raise InvalidRequest(f"{BAND_HEADER} must be one of {', '.join(BANDS)}, got {header!r}", BAND_HEADER)
    return max(key_band, asked, key=BANDS.index)


def tenant_share(tenant: str | None, queued_by_tenant: dict[str | None, int], rates: list[float]) -> TenantShare | None:
    """`queued_by_tenant` on the capable workers, `rates` their prefill rates; None when a rate is unmeasured."""
    if not rates or min(rates) <= 0:
        return None
    own = queued_by_tenant.get(tenant, 0)
    return TenantShare(own / sum(rates), len(set(queued_by_tenant) | {tenant}))


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


def check_wait(estimate: WaitEstimate | None, max_queue_wait_s: float | None, client_timeout_s: float | None,
               band: str = STANDARD, share: TenantShare | None = None) -> None:
    """Raise QueueWaitTooLong when the request is refused (module doc): over its client's timeout, or over its
    band's bound with its tenant at or over its equal share. `share` None: the bound alone decides."""
    if estimate is None:
        return
    wait = estimate.wait_s
    if client_timeout_s is not None and wait > client_timeout_s:
        _refuse(estimate, client_timeout_s, f"the client's timeout of {client_timeout_s:g} s")
    if max_queue_wait_s is None or band == CRITICAL:
        return
    if band == SHEDDABLE:
        bound = max_queue_wait_s * SHEDDABLE_SHARE
        if wait > bound:
            _refuse(estimate, bound, f"{bound:g} s, half of max_queue_wait_s, for sheddable work")
        return
    if wait <= max_queue_wait_s:
        return
    fair = max_queue_wait_s / share.tenants if share is not None else 0.0
    if share is not None and share.wait_s < fair:
        return  # under its equal share: others' work fills the queue, not this tenant's
    if share is None or share.tenants == 1:  # alone in the queue: the plain bound
        _refuse(estimate, max_queue_wait_s, f"max_queue_wait_s of {max_queue_wait_s:g} s")
    _refuse(estimate, max_queue_wait_s, f"max_queue_wait_s of {max_queue_wait_s:g} s, and this API key's "
            f"own queued work (about {share.wait_s:.1f} s) is over its equal share ({fair:.1f} s among "
            f"{share.tenants} API keys with work queued)", excess_s=share.wait_s - fair)


def _refuse(estimate: WaitEstimate, bound: float, what: str, excess_s: float | None = None) -> None:
    retry = max(1, math.ceil(estimate.wait_s - bound if excess_s is None else excess_s))
    raise QueueWaitTooLong(
        f"The engines are busy: this request would wait about {estimate.wait_s:.0f} s before it starts "
        f"(on worker {estimate.worker_id}, the least busy), over {what}. Retry after {retry} s.", retry)


async def admit(ctx: ServingContext, prep: Prepared, client_timeout_s: float | None, band: str = STANDARD) -> None:
    """Check one prepared request (its tenant is `prep.tenant`) in `band` against the gateway's workers now."""
    if ctx.config.limits.max_queue_wait_s is None and client_timeout_s is None:
        return  # no bound: nothing to estimate
    candidates = []
    for view in ctx.router.views():
        worker = ctx.fleet.get(view.worker_id)
        candidates.append((view, worker.load.prefill_tokens_per_s if worker and worker.load else 0.0))
    model_id = prep.model.model_id
    config = await ctx.state.get_routing(model_id) or ctx.config.routing
    req = route_request(ctx, prep, max_blocks=STICKY_BLOCKS)
    estimate = best_wait(candidates, model_id, request=req, config=config)
    share = None
    if estimate is not None:
        able = {v.worker_id for v in capable(req, [v for v, _ in candidates], config)}
        share = tenant_share(prep.tenant, ctx.pool_tracker.queued_by_tenant(able),
                             [rate for v, rate in candidates if v.worker_id in able])
    try:
        check_wait(estimate, ctx.config.limits.max_queue_wait_s, client_timeout_s, band, share)
    except QueueWaitTooLong:
        ctx.metrics.admission_refused.labels(model_id, band).inc()
        raise
