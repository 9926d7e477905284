"""deploy/grafana/duet.json must only query metrics that Duet really exports: the names are read from
the live registries of the gateway's metrics, the rollback controller and the engine worker's metrics."""

import importlib
import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from gateway.rollback import RollbackController
from gateway.state.memory import MemoryStore
from gateway.stats import RequestStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "duet.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def worker_registries() -> list[CollectorRegistry]:
    """The engine worker's registry, when that module exists in this checkout."""
    try:
        mod = importlib.import_module("engine_core.metrics")
    except ImportError:
        return []
    regs = [v for v in vars(mod).values() if isinstance(v, CollectorRegistry)]
    for cls in (v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__):
        try:
            obj = cls()
        except TypeError:
            continue
        regs.extend(v for v in vars(obj).values() if isinstance(v, CollectorRegistry))
    return regs


def all_exported() -> set[str]:
    names = exported_names(GatewayMetrics().registry)
    names |= exported_names(RollbackController(store=MemoryStore(), stats=RequestStats()).registry)
    for reg in worker_registries():
        names |= exported_names(reg)
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
                   "duet_route_decisions_total", "duet_worker_kv_cache_usage_perc", "duet_canary_rollbacks_total"):
        assert metric in exprs
