"""The admin API of a migration: the shadow run and the gated canary start (`duet migrate` calls them).

    GET    /admin/models/{model}/shadow         the shadow's config, figures (primary and shadow, overall and
                                                per traffic class), gate verdict, drops, sampling defaults
    PUT    /admin/models/{model}/shadow         start (or change) the shadow run: {pools, share,
                                                max_concurrency, drop_above_pending, window_s, gates}
    DELETE /admin/models/{model}/shadow         stop it
    POST   /admin/models/{model}/canary/start   start the canary of the shadow's candidate: refused (409
                                                shadow_gate_failed, with the failed bounds) until the shadow's
                                                figures pass its gates; then the candidate's variant gets a
                                                canary policy with the ramp and the same gates
                                                (gateway/control/rollback.py walks it and watches them)

A shadow's candidate must take no live traffic (else its figures would mix with the primary's): its pools
need a variant of weight 0 in the model's routing config, which `duet migrate shadow` writes first. The
routes are listed in the app beside gateway/control/admin.py's, with the same admin-key check and errors.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.control.admin import (
    AdminBackend,
    _check_model,
    _current_routing,
    _handler,
    _json_body,
    _require_gates,
)
from gateway.control.rollback import CanaryPolicy, PolicyError
from gateway.control.shadow import ShadowConfig, ShadowError
from gateway.errors import InvalidRequest

DEFAULT_RAMP = ({"weight": 10, "hold_s": 60}, {"weight": 50, "hold_s": 120}, {"weight": 100, "hold_s": 120})
CANARY_START_FIELDS = {"ramp", "window_s", "min_requests", "confirm_s", "max_ttft_p99_ratio",
                       "max_error_rate_increase"}


def _in_pool(pool, row: dict) -> bool:
    return row.get("engine_kind") == pool.engine_kind and pool.version in ("*", row.get("version"))


async def _answer(gateway: AdminBackend, model: str) -> dict:
    """The shadow's report and the sampling defaults of the candidate against the pools with live traffic."""
    config = gateway.shadow.configs.get(model)
    if config is None:
        return {"shadow": None, "sampling_defaults": None}
    live = tuple(p for v in (await _current_routing(gateway, model)).variants if v.weight > 0 for p in v.pools)
    return {"shadow": gateway.shadow.report(model), "sampling_defaults": gateway.sampling_defaults(config, live)}


def migration_routes(gateway: AdminBackend) -> list[Route]:
    async def get_shadow(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        return JSONResponse(await _answer(gateway, model))

    async def put_shadow(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        try:
            config = ShadowConfig.from_dict(model, await _json_body(request), gateway.shadow.max_window_s)
        except ShadowError as e:
            raise InvalidRequest(str(e)) from None
        mine = [w for w in gateway.worker_rows() if w.get("model_id") == model]
        candidates = [w for w in mine if any(_in_pool(p, w) for p in config.pools)]
        if not candidates:
            known = sorted({f"{w.get('engine_kind')}@{w.get('version')}" for w in mine})
            raise InvalidRequest(f"no worker of model {model!r} is in the candidate pools (pools that exist: "
                                 f"{', '.join(known) or 'none'})", "pools")
        routing = await _current_routing(gateway, model)
        live = [v for v in routing.variants if v.weight > 0]
        reached = [w["worker_id"] for w in candidates
                   if not routing.variants or any(_in_pool(p, w) for v in live for p in v.pools)]
        if reached:
            raise InvalidRequest(
                f"the candidate takes live traffic now ({', '.join(reached)}): give its pools a variant of weight "
                f"0 in the routing config of {model!r} first (`duet migrate shadow` does)", "pools")
        await gateway.shadow_sync.publish(model, config)  # every replica mirrors and gates alike
        return JSONResponse(await _answer(gateway, model))

    async def delete_shadow(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        await gateway.shadow_sync.publish(model, None)
        return JSONResponse({"shadow": None})

    async def start_canary(request: Request, actor: str) -> Response:
        model = request.path_params["model"]
        _check_model(gateway, model)
        body = await _json_body(request) if await request.body() else {}
        if not isinstance(body, dict) or set(body) - CANARY_START_FIELDS:
            raise InvalidRequest(f"the body is an object of optional {', '.join(sorted(CANARY_START_FIELDS))}")
        config = gateway.shadow.configs.get(model)
        if config is None:
            raise InvalidRequest(f"no shadow runs for {model!r}: a canary starts from a shadow run that passed "
                                 f"its gates (PUT /admin/models/{model}/shadow, `duet migrate shadow`)")
        _require_gates(gateway, model)
        routing = await _current_routing(gateway, model)
        canary = next((v for v in routing.variants if set(v.pools) == set(config.pools)), None)
        baselines = [v for v in routing.variants if v.weight > 0 and v is not canary]
        if canary is None or len(baselines) != 1:
            raise InvalidRequest(f"the routing config of {model!r} needs one variant of the candidate's pools and "
                                 f"one other variant with traffic (found {len(baselines)})")
        try:
            policy = CanaryPolicy.from_dict(model, {
                "canary": canary.name, "baseline": baselines[0].name, "ramp": list(DEFAULT_RAMP),
                "window_s": config.window_s, **body, "gates": config.gates.to_dict()})
        except PolicyError as e:
            raise InvalidRequest(str(e)) from None
        if policy.window_s > gateway.stats.max_window_s:
            raise InvalidRequest(f"window_s must be at most {gateway.stats.max_window_s:g} s (the stats horizon)")
        gateway.rollback.set_policy(policy)
        return JSONResponse({"policy": policy.to_dict(), "verdict": gateway.shadow.verdict(model).to_dict()})

    def h(fn):
        return _handler(gateway, fn)

    return [
        Route("/admin/models/{model:path}/shadow", h(get_shadow), methods=["GET"]),
        Route("/admin/models/{model:path}/shadow", h(put_shadow), methods=["PUT"]),
        Route("/admin/models/{model:path}/shadow", h(delete_shadow), methods=["DELETE"]),
        Route("/admin/models/{model:path}/canary/start", h(start_canary), methods=["POST"]),
    ]
