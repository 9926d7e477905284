"""The probes and the scrape: `/health` (the process answers), `/ready` (every served model has a
healthy, non-draining worker) and `/metrics` (Prometheus text, gateway/metrics.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.metrics import CONTENT_TYPE
from gateway.serving.context import serving_context


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 when every served model has at least one healthy, non-draining worker."""
    ctx = serving_context(request)
    views = ctx.router.views()
    per_model = {m: sum(1 for v in views if v.model_id == m and v.healthy and not v.draining)
                 for m in ctx.models}
    ok = bool(per_model) and all(per_model.values())
    return JSONResponse({"ready": ok, "healthy_workers": per_model}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    return Response(serving_context(request).metrics.render(), media_type=CONTENT_TYPE)
