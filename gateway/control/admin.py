"""The admin API (admin key required) and the dashboard's static files.

Routes (`admin_routes(gateway)` returns them for the app's route list):

    GET  /admin/models/{model}/routing          the model's RoutingConfig as JSON (defaults when unset)
    PUT  /admin/models/{model}/routing          validate, apply through the StateStore (every replica), audit
    GET|PUT|DELETE /admin/models/{model}/canary-policy   automatic rollback bounds and ramp (gateway/control/rollback.py)
    GET  /admin/workers                          health, version, load, KV usage, prefix hit rate, draining, the
                                                 engine behind it (duet, vllm, sglang, openai) and its measured
                                                 prefill and decode rates (what advise calibrates from)
    POST /admin/workers/{worker_id}/drain        stop routing to the worker; running requests finish
    GET  /admin/pools                            the pool planner: {"target": {"paged": N, "prefix": M},
                                                 "current": {...}, "work": {...}, ...} (gateway/control/pool_planner.py)
    GET  /admin/decisions?limit=N                the last N routing decisions, newest first
    GET  /admin/audit?limit=N                    config changes, newest first (time, actor = key id, before, after)
    GET  /admin/stats/stream                     SSE, one `data:` event a second with what the dashboard draws
    .../shadow, .../canary/start                 the shadow run and the gated canary start: gateway/control/migration.py
    GET  /dashboard, /dashboard/{file}           the ops page (no key needed to load it; it asks for the key)

`gateway` is any object with the attributes of `AdminBackend`; bad input raises the typed errors of
gateway/errors.py, which become OpenAI-shaped 4xx responses here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.body_parser import parse_json_body
from gateway.control.rollback import CanaryPolicy, PolicyError, RollbackController
from gateway.control.shadow import ShadowConfig, ShadowLedger
from gateway.control.state import StateUnavailable
from gateway.control.state.codec import config_from_dict, config_to_dict
from gateway.control.stats import RequestStats
from gateway.errors import (
    AuthenticationFailed,
    GateFailed,
    GatewayError,
    InvalidRequest,
    PermissionDenied,
    StateStoreUnavailable,
    WorkerNotFound,
    error_response,
)
from gateway.routing.decision_log import DecisionLog
from gateway.routing.route_types import Pool, RoutingConfig, RoutingConfigError

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
STREAM_INTERVAL_S = 1.0
STREAM_WINDOW_S = 10.0  # rates and percentiles on the stream are over the last 10 s
MAX_LIMIT = 1000


class AdminBackend(Protocol):
    """What the admin API needs from the running gateway."""

    state: Any  # gateway.control.state.StateStore
    stats: RequestStats
    decisions: DecisionLog
    rollback: RollbackController
    shadow: ShadowLedger
    shadow_sync: Any  # gateway.control.shadow_sync.ShadowSync: a shadow change goes to every replica
    admin_key: str | None  # None: the admin API answers 403 (disabled)

    def model_ids(self) -> list[str]:
        """Models this gateway serves."""

    def worker_rows(self) -> list[dict]:
        """One dict per known worker: worker_id, model_id, engine_kind, version, healthy, draining,
        num_running, num_waiting, kv_usage (0..1), prefix_hit_rate (0..1); the running gateway's rows add engine,
        page_size, max_model_len, prefill_tokens_per_s, prefill_rate_source, decode_tokens_per_s and
        decode_tokens_per_step."""

    def drain_worker(self, worker_id: str) -> bool | Awaitable[bool]:
        """Stop routing to the worker (running requests finish). False: no such worker."""

    def pool_report(self) -> dict:
        """The pool planner's report (gateway/control/pool_tracker.PoolTracker.report)."""

    def sampling_defaults(self, config: ShadowConfig, live: tuple[Pool, ...] = ()) -> dict:
        """Each side's sampling defaults for a shadow run (GatewayAdmin.sampling_defaults)."""


def key_id(key: str) -> str:
    """What the audit log records instead of the key itself."""
    return "admin-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _authorize(gateway: AdminBackend, request: Request) -> str:
    """The caller's key id, or raise (401 bad/missing key, 403 admin API disabled)."""
    expected = gateway.admin_key
    if not expected:
        raise PermissionDenied("the admin API is disabled: start the gateway with --admin-key or DUET_ADMIN_KEY")
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-admin-key", "")
    if not given or not hmac.compare_digest(given.encode(), expected.encode()):
        raise AuthenticationFailed("a valid admin key is required (Authorization: Bearer <admin key>)")
    return key_id(given)


def _handler(gateway: AdminBackend, fn: Callable[[Request, str], Awaitable[Response]]):
    async def endpoint(request: Request) -> Response:
        try:
            actor = _authorize(gateway, request)
            return await fn(request, actor)
        except GatewayError as e:
            return error_response(e)
        except StateUnavailable as e:
            return error_response(StateStoreUnavailable(f"the change could not reach the shared state store: {e}"))
    return endpoint


def _limit(request: Request, default: int = 100) -> int:
    raw = request.query_params.get("limit", str(default))
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"limit must be an integer, got {raw!r}", "limit") from None
    if not 1 <= value <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be within 1..{MAX_LIMIT}, got {value}", "limit")
    return value


async def _json_body(request: Request) -> Any:
    return parse_json_body(await request.body())


def _check_model(gateway: AdminBackend, model: str) -> None:
    if model not in gateway.model_ids():
        raise InvalidRequest(f"unknown model {model!r}; served: {', '.join(gateway.model_ids()) or 'none'}", "model")


def validate_routing(data: Any, workers: list[dict], model: str) -> RoutingConfig:
    """Parse and check an operator's routing config; raises InvalidRequest with the reason.

    Beyond RoutingConfig.validate (weights >= 0 with a positive sum, thresholds in range, known engine
    kinds), every pool must match at least one worker of the model, so a typo in a version label cannot
    send a variant's traffic nowhere."""
    try:
        config = config_from_dict(data)
    except RoutingConfigError as e:
        raise InvalidRequest(str(e)) from None
    if config.variants and sum(v.weight for v in config.variants) <= 0:
        raise InvalidRequest("variant weights must have a positive sum")
    mine = [w for w in workers if w.get("model_id") in (model, None, "")]
    for v in config.variants:
        for p in v.pools:
            if not any(w.get("engine_kind") == p.engine_kind and p.version in ("*", w.get("version")) for w in mine):
                known = sorted({f"{w.get('engine_kind')}@{w.get('version')}" for w in mine})
                raise InvalidRequest(
                    f"variant {v.name!r}: no worker of model {model!r} is in pool "
                    f"{p.engine_kind}@{p.version} (pools that exist: {', '.join(known) or 'none'})"
                )
    return config


def _candidate_weight(gateway: AdminBackend, model: str, config: RoutingConfig) -> float:
    """The weight a routing config gives the variants holding the model's shadow candidate (0: no shadow)."""
    shadow = gateway.shadow.configs.get(model)
    if shadow is None:
        return 0.0
    return sum(v.weight for v in config.variants if set(v.pools) & set(shadow.pools))


def _require_gates(gateway: AdminBackend, model: str) -> None:
    """Raise GateFailed (409, with the failed bounds) unless the model's shadow passed its gates."""
    why = gateway.shadow.gate_error(model)
    if why is not None:
        raise GateFailed(f"no canary started: {why}")


async def _current_routing(gateway: AdminBackend, model: str) -> RoutingConfig:
    """What the gateway routes this model with: the stored config, else the config file's default."""
    stored = await gateway.state.get_routing(model)
    if stored is not None:
        return stored
    config = getattr(gateway, "config", None)
    return getattr(config, "routing", None) or RoutingConfig()


async def stream_event(gateway: AdminBackend) -> dict:
    """One event of /admin/stats/stream (also what tests read)."""
    routing = {}
    for model in gateway.model_ids():
        routing[model] = config_to_dict(await _current_routing(gateway, model))
    rb = gateway.rollback
    return {
        "t": time.time(),
        "stats": gateway.stats.snapshot(STREAM_WINDOW_S),
        "workers": gateway.worker_rows(),
        "pools": gateway.pool_report() if hasattr(gateway, "pool_report") else None,
        "routing": routing,
        "rollback": {
            "events": list(rb.events),
            "policies": {m: p.to_dict() for m, p in rb.policies.items()},
            "status": {m: rb.status(m) for m in rb.policies},
        },
        "shadow": {m: gateway.shadow.report(m) for m in gateway.shadow.configs},
    }


def admin_routes(gateway: AdminBackend) -> list[Route]:
    """The admin API and dashboard routes, to be listed in the gateway's Starlette app."""

    async def get_routing(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        return JSONResponse(config_to_dict(await _current_routing(gateway, model)))

    async def put_routing(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        config = validate_routing(await _json_body(request), gateway.worker_rows(), model)
        before = await _current_routing(gateway, model)
        if _candidate_weight(gateway, model, config) > _candidate_weight(gateway, model, before):
            _require_gates(gateway, model)  # more traffic for a shadow's candidate: its gates must pass
        await gateway.state.put_routing(model, config, actor)
        return JSONResponse(config_to_dict(config))

    async def get_policy(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        policy = gateway.rollback.policies.get(model)
        return JSONResponse({"policy": policy.to_dict() if policy else None, **gateway.rollback.status(model)})

    async def put_policy(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        try:
            policy = CanaryPolicy.from_dict(model, await _json_body(request))
        except PolicyError as e:
            raise InvalidRequest(str(e)) from None
        if policy.window_s > gateway.stats.max_window_s:
            raise InvalidRequest(f"window_s must be at most {gateway.stats.max_window_s:g} s (the stats horizon)")
        names = {v.name for v in (await _current_routing(gateway, model)).variants}
        missing = {policy.canary, policy.baseline} - names
        if missing:
            raise InvalidRequest(f"the routing config of {model!r} has no variant {', '.join(sorted(missing))}")
        shadow = gateway.shadow.configs.get(model)
        if shadow is not None and policy.ramp and any(
                v.name == policy.canary and set(v.pools) & set(shadow.pools)
                for v in (await _current_routing(gateway, model)).variants):
            _require_gates(gateway, model)  # a ramp would give the shadow's candidate traffic
        gateway.rollback.set_policy(policy)
        return JSONResponse({"policy": policy.to_dict()})

    async def delete_policy(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        gateway.rollback.set_policy(None, model)
        return JSONResponse({"policy": None})

    async def list_workers(request: Request, actor: str) -> Response:
        return JSONResponse({"workers": gateway.worker_rows()})

    async def drain(request: Request, actor: str) -> Response:
        worker_id = request.path_params["worker_id"]
        found = gateway.drain_worker(worker_id)
        if asyncio.iscoroutine(found):
            found = await found
        if not found:
            raise WorkerNotFound(f"no worker {worker_id!r}")
        return JSONResponse({"worker_id": worker_id, "draining": True})

    async def pools(request: Request, actor: str) -> Response:
        return JSONResponse(gateway.pool_report())

    async def decisions(request: Request, actor: str) -> Response:
        return JSONResponse({"decisions": gateway.decisions.recent(_limit(request))})

    async def audit(request: Request, actor: str) -> Response:
        return JSONResponse({"entries": await gateway.state.audit_log(_limit(request))})

    async def stats_stream(request: Request, actor: str) -> Response:
        async def events():
            while True:
                payload = json.dumps(await stream_event(gateway), separators=(",", ":"))
                yield f"data: {payload}\n\n"
                await asyncio.sleep(STREAM_INTERVAL_S)
        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
        )

    def h(fn):
        return _handler(gateway, fn)

    return [
        Route("/admin/models/{model:path}/routing", h(get_routing), methods=["GET"]),
        Route("/admin/models/{model:path}/routing", h(put_routing), methods=["PUT"]),
        Route("/admin/models/{model:path}/canary-policy", h(get_policy), methods=["GET"]),
        Route("/admin/models/{model:path}/canary-policy", h(put_policy), methods=["PUT"]),
        Route("/admin/models/{model:path}/canary-policy", h(delete_policy), methods=["DELETE"]),
        Route("/admin/workers", h(list_workers), methods=["GET"]),
        Route("/admin/workers/{worker_id}/drain", h(drain), methods=["POST"]),
        Route("/admin/pools", h(pools), methods=["GET"]),
        Route("/admin/decisions", h(decisions), methods=["GET"]),
        Route("/admin/audit", h(audit), methods=["GET"]),
        Route("/admin/stats/stream", h(stats_stream), methods=["GET"]),
        Route("/dashboard", _dashboard_index, methods=["GET"]),
        Route("/dashboard/{path:path}", _dashboard_file, methods=["GET"]),
    ]


async def _dashboard_index(request: Request) -> Response:
    return FileResponse(DASHBOARD_DIR / "index.html")


async def _dashboard_file(request: Request) -> Response:
    rel = request.path_params["path"]
    if rel in ("", "index.html"):
        return FileResponse(DASHBOARD_DIR / "index.html")
    target = (DASHBOARD_DIR / rel).resolve()
    # no path traversal out of the dashboard folder
    if DASHBOARD_DIR.resolve() not in target.parents or not target.is_file():
        return JSONResponse({"error": {"message": "not found", "type": "not_found"}}, status_code=404)
    return FileResponse(target)
