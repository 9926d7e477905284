"""deploy/prometheus/duet-rules.yml, the alert rules: `promtool test rules` passes on
tests/deploy/alerts_test.yml, every alert there has a firing case and a quiet case, every alert has a
runbook line in docs/operations.md, the rules name only metrics Duet exports, and the Kubernetes
PrometheusRule carries exactly the same groups.

    python tests/deploy/test_alert_rules.py --write    # regenerate deploy/k8s/base/prometheus-rules.yaml
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "duet-rules.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "base" / "prometheus-rules.yaml"
PROMTOOL_TESTS = Path(__file__).parent / "alerts_test.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
_HEADER = """\
# GENERATED from deploy/prometheus/duet-rules.yml (the source of truth; edit that file, then run
# `python tests/deploy/test_alert_rules.py --write`). Prometheus Operator (kube-prometheus-stack) loads it;
# tests/deploy/test_alert_rules.py fails when the two differ.
"""


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alert_names() -> list[str]:
    return [r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r]


def prometheus_rule() -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "duet-alerts", "labels": {"app.kubernetes.io/name": "duet"}},
            "spec": {"groups": rule_groups()}}


def _literal_blocks(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


def render_prometheus_rule() -> str:
    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(str, _literal_blocks)
    return _HEADER + yaml.dump(prometheus_rule(), Dumper=Dumper, sort_keys=False, width=120)


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (`make setup` installs Debian's prometheus package)")
    return found


def test_promtool_unit_tests_pass():
    out = subprocess.run([promtool(), "test", "rules", str(PROMTOOL_TESTS)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_file_is_valid_for_promtool():
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_prometheus_config_is_valid_with_the_rules(tmp_path):
    """deploy/compose/prometheus.yml as Prometheus reads it, its rule_files pointed at the repository's file
    (in the container the file is mounted at the path the config names)."""
    config = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/duet-rules.yml"]
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in rule_groups())
    assert "1 rule files found" in out.stdout and f"{n} rules found" in out.stdout, out.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases = [t for group in yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"] for t in group["alert_rule_test"]]
    fires = {t["alertname"] for t in cases if t.get("exp_alerts")}
    quiet = {t["alertname"] for t in cases if not t.get("exp_alerts")}
    names = set(alert_names())
    assert names - fires == set(), "alerts no promtool case makes fire"
    assert names - quiet == set(), "alerts no promtool case shows quiet"
    assert (fires | quiet) - names == set(), "promtool cases for alerts that do not exist"


def test_every_alert_has_a_runbook_line():
    text = OPERATIONS.read_text()
    section = text.split("## Alerts and their runbook", 1)
    assert len(section) == 2, "docs/operations.md has no 'Alerts and their runbook' section"
    body = section[1].split("\n## ", 1)[0]
    for name in alert_names():
        lines = [ln for ln in body.splitlines() if f"`{name}`" in ln]
        assert lines, f"{name} has no runbook line in docs/operations.md"
        assert len(lines[0]) > len(name) + 40, f"{name}'s runbook line says nothing: {lines[0]!r}"
    for rule in (r for g in rule_groups() for r in g["rules"] if "alert" in r):
        assert rule["annotations"]["runbook_url"] == "docs/operations.md#alerts-and-their-runbook"
        assert rule["labels"]["severity"] in ("page", "ticket")


def test_rules_query_only_exported_metrics():
    from tests.dashboard.test_grafana import all_exported

    exported = all_exported()
    groups = rule_groups()
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    for rule in (r for g in groups for r in g["rules"]):
        used = set(re.findall(r"\bduet[_:][a-zA-Z0-9_:]+", rule["expr"]))
        assert used, rule
        assert used - exported - recorded == set(), f"{rule.get('alert') or rule['record']} queries unknown metrics"


def test_prometheus_rule_is_the_rules_file():
    assert PROMETHEUS_RULE.read_text() == render_prometheus_rule(), \
        "deploy/k8s/base/prometheus-rules.yaml differs from the rules file: python tests/deploy/test_alert_rules.py --write"
    assert "prometheus-rules.yaml" in yaml.safe_load((PROMETHEUS_RULE.parent / "kustomization.yaml").read_text())[
        "resources"]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        PROMETHEUS_RULE.write_text(render_prometheus_rule())
        print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}")
    else:
        sys.exit(__doc__)
