"""`Workload`: the live profile (gateway/control/profile.py) and the traffic capture (gateway/control/capture.py)
behind the one call the request path makes when a request ends (`finished`, from gateway/serving/runs.py), their
gauges on /metrics, and their admin routes:

    GET /admin/profile?window_s=60      the profile per model and overall ("*"), JSON
    GET /admin/capture                  the capture as Mooncake JSONL (what `duet capture export` writes)

Both routes take the admin key (gateway/control/admin.py). gateway/app.py builds one `Workload` per gateway.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.control.admin import _handler
from gateway.control.capture import CaptureConfig, TraceCapture
from gateway.control.profile import WorkloadProfile
from gateway.errors import InvalidRequest

METRICS_WINDOW_S = 60.0  # the /metrics gauges describe the last minute


class Workload:
    def __init__(self, capture: CaptureConfig, state, registry=None, profile: bool = True) -> None:
        self.profiling = profile  # off: the profile stays empty (the cost benchmark's baseline)
        self.profile = WorkloadProfile()
        self.capture = TraceCapture(capture, state)
        if registry is not None:
            registry.register(_ProfileCollector(self.profile))

    def finished(self, *, model: str, session: str | None, turns: int, hashes: Sequence[int],
                 prompt_ids: Sequence[int], tenant_salt: str, output_tokens: int, cached_tokens: int,
                 traffic_class: str, engine: str, duration_s: float, ttft_s: float | None,
                 tpot_s: float | None) -> None:
        """One request answered in full (status 200)."""
        if self.profiling:
            self.profile.record(model=model, session=session, turns=turns, hashes=hashes,
                                prompt_tokens=len(prompt_ids), output_tokens=output_tokens,
                                traffic_class=traffic_class, engine=engine, cached_tokens=cached_tokens,
                                duration_s=duration_s)
        self.capture.record(model=model, prompt_ids=prompt_ids, tenant_salt=tenant_salt, session=session,
                            output_tokens=output_tokens, traffic_class=traffic_class, engine=engine,
                            duration_s=duration_s, ttft_s=ttft_s, tpot_s=tpot_s)


class _ProfileCollector:
    """The profile's last minute as gauges, computed when /metrics is scraped."""

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile

    def describe(self):
        return []  # computed at scrape time only

    def collect(self):
        snap = self.profile.snapshot(METRICS_WINDOW_S)["models"]
        rep = GaugeMetricFamily("duet_profile_prefix_repetition", "Share of prompt blocks seen before, last "
                                "minute (scope: within_session, cross_session, any)", labels=("model", "scope"))
        rate = GaugeMetricFamily("duet_profile_arrival_rate", "Requests per second, last minute", labels=("model",))
        conc = GaugeMetricFamily("duet_profile_concurrency", "Mean requests in flight, last minute",
                                 labels=("model",))
        peak = GaugeMetricFamily("duet_profile_concurrency_peak", "Most requests in flight at once, last minute "
                                 "(finished requests' spans)", labels=("model",))
        lengths = GaugeMetricFamily("duet_profile_tokens", "Prompt and output length, last minute (kind: prompt, "
                                    "output; stat: mean, p50, p90, p99)", labels=("model", "kind", "stat"))
        turns = GaugeMetricFamily("duet_profile_session_turns", "Session length in turns, last minute (stat: mean, "
                                  "p50, p90, p99)", labels=("model", "stat"))
        mix = GaugeMetricFamily("duet_profile_class_share", "Share of requests per traffic class, last minute",
                                labels=("model", "class"))
        hits = GaugeMetricFamily("duet_profile_engine_hit_rate", "Prompt tokens served from cache per engine kind, "
                                 "last minute", labels=("model", "engine"))
        for model, p in snap.items():
            for scope in ("within_session", "cross_session", "any"):
                if p["prefix_repetition"][scope] is not None:
                    rep.add_metric((model, scope), p["prefix_repetition"][scope])
            rate.add_metric((model,), p["arrival_rps"])
            conc.add_metric((model,), p["concurrency_mean"])
            peak.add_metric((model,), p["concurrency_peak"])
            for stat in ("mean", "p50", "p90", "p99"):
                for kind in ("prompt", "output"):
                    if p[f"{kind}_tokens"][stat] is not None:
                        lengths.add_metric((model, kind, stat), p[f"{kind}_tokens"][stat])
                if p["session_turns"][stat] is not None:
                    turns.add_metric((model, stat), p["session_turns"][stat])
            for cls, share in p["classes"].items():
                mix.add_metric((model, cls), share)
            for engine, e in p["engines"].items():
                if e["hit_rate"] is not None:
                    hits.add_metric((model, engine), e["hit_rate"])
        return [rep, rate, conc, peak, lengths, turns, mix, hits]


def workload_routes(admin, workload: Workload) -> list[Route]:
    """GET /admin/profile and /admin/capture, behind `admin`'s key (an AdminBackend, gateway/control/admin.py)."""

    async def profile(request: Request, actor: str) -> Response:
        raw = request.query_params.get("window_s", "60")
        try:
            window_s = float(raw)
        except ValueError:
            raise InvalidRequest(f"window_s must be a number of seconds, got {raw!r}", "window_s") from None
        limit = workload.profile.max_window_s
        if not 0 < window_s <= limit:
            raise InvalidRequest(f"window_s must be within (0, {limit:g}], got {raw}", "window_s")
        return JSONResponse(workload.profile.snapshot(window_s))

    async def capture(request: Request, actor: str) -> Response:
        lines = await workload.capture.export()
        body = "".join(line + "\n" for line in lines)
        return Response(body, media_type="application/x-ndjson",
                        headers={"x-duet-capture-records": str(len(lines)),
                                 "x-duet-capture-enabled": str(workload.capture.config.enabled).lower()})

    return [Route("/admin/profile", _handler(admin, profile), methods=["GET"]),
            Route("/admin/capture", _handler(admin, capture), methods=["GET"])]
