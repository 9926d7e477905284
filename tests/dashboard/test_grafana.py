"""deploy/grafana/duet.json must only query metrics that Duet really exports: the names are read from
the live registries of the gateway's metrics, the rollback controller and the engine worker's metrics."""

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from engine_core.metrics import EngineMetrics
from gateway.control.rollback import RollbackController
from gateway.control.state.memory import MemoryStore
from gateway.control.stats import RequestStats
from gateway.metrics import GatewayMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "duet.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def all_exported() -> set[str]:
    names = exported_names(GatewayMetrics().registry)
    names |= exported_names(RollbackController(store=MemoryStore(), stats=RequestStats()).registry)
    names |= exported_names(EngineMetrics("paged", "m").registry)
    return names


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_dashboard_is_valid_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["type"] == "prometheus"


def test_every_panel_query_names_an_exported_metric():
    exported = all_exported()
    dash = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dash) + [("variable " + v["name"], v["query"])
                                     for v in dash["templating"]["list"] if v["type"] == "query"]
    for title, expr in queries:
        used = set(re.findall(r"\bduet_[a-zA-Z0-9_]+", expr))
        assert used, f"{title!r} queries no duet_ metric: {expr}"
        missing = used - exported
        assert not missing, f"{title!r} queries metrics nobody exports: {sorted(missing)}"


def test_dashboard_covers_the_operator_questions():
    exprs = " ".join(e for _, e in panel_queries(json.loads(DASHBOARD.read_text())))
    for metric in ("duet_time_to_first_token_seconds_bucket", "duet_inter_token_latency_seconds_bucket",
                   "duet_route_decisions_total", "duet_worker_kv_cache_usage_perc", "duet_canary_rollbacks_total",
                   "duet_pool_target_workers", "duet_route_cached_tokens_error_bucket",
                   "duet_route_stale_decisions_total"):
        assert metric in exprs
