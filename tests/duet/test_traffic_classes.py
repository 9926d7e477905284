"""The one traffic-class table (duet/traffic_classes.py) and every consumer of it: the gateway's class label, the
class benchmarks' and compare's SLOs, the fleet simulator's goodput and `duet bench advise` judge by the table's
bounds (the alert rules: tests/deploy/test_slo_rules.py). A changed bound in the table reaches each of them."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from duet.traffic_classes import (
    ALIASES,
    BENCH_CLASSES,
    CLASSES,
    CPU,
    DOCUMENT_PROMPT_TOKENS,
    FLEET_CLASSES,
    GPU,
    PROFILES,
    TABLE,
    UNCLASSIFIED,
    bound_of,
    classify,
    markdown,
)
from gateway.api.protocol import parse_completions
from gateway.serving.request_class import request_class
from loadtests.load.class_slo import COST_MODEL_PROFILES, FLEET_SLOS, ClassSlo, parse_class_slos
from loadtests.load.class_workloads import CLASSES as BENCH_WORKLOAD_CLASSES
from loadtests.sim.fleet.cost_models import COST_MODELS
from loadtests.sim.fleet.workload import CLASSES as FLEET_WORKLOAD_CLASSES
from tests.gateway.test_request_class import _chat  # a parsed chat of these user turns

ROOT = Path(__file__).resolve().parents[2]


def test_every_class_of_every_vocabulary_is_one_row_of_the_table():
    assert CLASSES == ("structured", "session", "document", "oneshot")
    assert set(ALIASES.values()) <= set(CLASSES)
    assert set(BENCH_WORKLOAD_CLASSES) <= set(BENCH_CLASSES)  # duet bench classes' five
    assert FLEET_WORKLOAD_CLASSES == tuple(FLEET_CLASSES)
    assert set(COST_MODEL_PROFILES) == set(COST_MODELS) and set(COST_MODEL_PROFILES.values()) <= set(PROFILES)
    for c in TABLE:
        for profile in PROFILES:
            b = c.bound(profile)
            assert b.ttft_ms > 0 and b.itl_ms > 0, (c.name, profile)
    assert bound_of("long_doc", CPU).ttft_bound_ms(1024) == pytest.approx(8096.0)  # 4 s + 4 ms a token
    with pytest.raises(KeyError):
        bound_of("poetry", GPU)
    with pytest.raises(ValueError, match="unknown SLO profile"):
        bound_of("session", "tpu")


def test_the_gateway_labels_requests_by_the_tables_rule():
    one = _chat("hi")
    structured = _chat("hi", response_format={"type": "json_object"})
    completion = parse_completions({"model": "m", "prompt": "hi"})[0]
    for api, key, n in ((one, None, 12), (one, "conv", 12), (_chat("a", "b"), None, 12), (structured, "c", 5000),
                        (completion, None, DOCUMENT_PROMPT_TOKENS), (completion, None, DOCUMENT_PROMPT_TOKENS - 1)):
        conversation = bool(key) or (api.kind == "chat" and api.turn_count > 1)
        structured_output = "structured_output" in api.required_capabilities
        assert request_class(api, key, n) == classify(structured_output, conversation, n) in CLASSES
    assert {request_class(completion, None, n) for n in (1, DOCUMENT_PROMPT_TOKENS)} == {"oneshot", "document"}


def test_the_benchmarks_and_the_fleet_judge_by_the_tables_bounds():
    bench = ClassSlo()
    for name in BENCH_CLASSES:
        assert bench.bound(name) == bound_of(name, CPU), name  # duet bench classes, compare --pin-cores
    assert bench.bound("mooncake") == UNCLASSIFIED
    for cost_model, profile in COST_MODEL_PROFILES.items():
        for name in FLEET_CLASSES:
            assert FLEET_SLOS[cost_model].bound(name) == bound_of(name, profile), (cost_model, name)
    assert FLEET_SLOS["h200"].bound("chat") == bound_of("session", GPU)  # what the alerts page on
    overridden = parse_class_slos("chat.ttft=2s", FLEET_SLOS["h200"], FLEET_CLASSES, "--slo")
    assert overridden.bound("chat").itl_ms == bound_of("session", GPU).itl_ms
    assert overridden.bound("document") == bound_of("document", GPU)


def test_the_compare_and_advise_defaults_are_the_tables():
    from loadtests.advise.cli import LOCAL, SIMULATE, mode_of
    from loadtests.advise.routing_sim import AdviseSettings
    from loadtests.experiments.compare import Settings

    assert (Settings().ttft_slo_ms, Settings().itl_slo_ms) == (UNCLASSIFIED.ttft_ms, UNCLASSIFIED.itl_ms)
    assert AdviseSettings().slo_ttft_s == bound_of("session", CPU).ttft_ms / 1000
    from loadtests.cli import build_parser

    for flags, mode in (([], LOCAL), (["--simulate"], SIMULATE)):
        args = build_parser().parse_args(["advise", *flags])
        assert mode_of(args) == mode and args.slo_ttft_s == bound_of("session", CPU).ttft_ms / 1000


def test_advise_fleet_judges_by_the_cost_models_profile(monkeypatch):
    from loadtests.advise import cli, fleet

    seen = []
    monkeypatch.setattr(fleet, "advise", lambda s, *a, **k: seen.append(s) or {})
    for cost_model in ("h200", "cpu"):
        args = Namespace(cost_model=cost_model, workers=4, trace="mixed", window_s=10.0, rate=1.0,
                         class_slo="document.tpot=300", worker_hour_usd=None, validate=False)
        cli._fleet(args)
        slos, profile = seen[-1].slos, COST_MODEL_PROFILES[cost_model]
        assert slos.bound("chat") == bound_of("session", profile)
        assert slos.bound("document").ttft_ms == bound_of("document", profile).ttft_ms
        assert slos.bound("document").itl_ms == 300.0


_PATCHED = """
import dataclasses, json
from duet import traffic_classes as t
t.TABLE = tuple(dataclasses.replace(c, gpu=t.ClassBound(750.0, 75.0), cpu=t.ClassBound(1500.0, 200.0))
                if c.name == "session" else c for c in t.TABLE)
from duet.slo_alerts import render
from loadtests.advise.routing_sim import AdviseSettings
from loadtests.load.class_slo import ClassSlo, FLEET_SLOS
from loadtests.sim.fleet.report import parse_slos
print(json.dumps({"bench": ClassSlo().bound("agent").describe(), "h200": FLEET_SLOS["h200"].bound("chat").describe(),
                  "cpu": parse_slos(None, "cpu").bound("chat").describe(), "advise_s": AdviseSettings().slo_ttft_s,
                  "doc": ClassSlo().bound("long_doc").describe(), "rules": render()}))
"""


def test_a_bound_changed_in_the_table_reaches_every_consumer():
    """The table patched before anything reads it (a fresh interpreter): session's bounds move everywhere,
    document's stay."""
    out = subprocess.run([sys.executable, "-c", _PATCHED], capture_output=True, text=True, timeout=120, check=True,
                         cwd=ROOT)
    got = json.loads(out.stdout)
    assert got["bench"] == {"ttft_ms": 1500.0, "ttft_ms_per_prompt_token": 0.0, "itl_ms": 200.0}
    assert got["cpu"] == got["bench"] and got["advise_s"] == 1.5
    assert got["h200"] == {"ttft_ms": 750.0, "ttft_ms_per_prompt_token": 0.0, "itl_ms": 75.0}
    assert got["doc"] == bound_of("long_doc", CPU).describe()
    assert 'class="session", le="0.75"' in got["rules"] and 'class="session", le="0.075"' in got["rules"]
    assert 'class="document", le="10.0"' in got["rules"]


def test_the_operations_page_shows_the_table():
    assert markdown() in (ROOT / "docs" / "operations.md").read_text(), \
        "docs/operations.md's class table differs from duet/traffic_classes.py: paste `python -m duet.traffic_classes`"
