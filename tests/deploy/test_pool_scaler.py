"""duet/pool_scaler.py: the decision rules (pure) and the exact request the official kubernetes client
builds for a change (its own request serializer, no API server needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from duet.pool_scaler import (
    MERGE_PATCH,
    Bounds,
    DeploymentScales,
    PoolTargetError,
    ScaleChange,
    parse_deployments,
    parse_targets,
    plan,
)

kubernetes = pytest.importorskip("kubernetes")
ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = {"paged": "engine-paged", "prefix": "engine-prefix"}


def test_parse_targets_contract():
    assert parse_targets({"target": {"paged": 3, "prefix": 0}}) == {"paged": 3, "prefix": 0}
    for bad in ({}, {"target": [1, 2]}, {"target": {"paged": -1}}, {"target": {"paged": 1.5}},
                {"target": {"paged": True}}, ["target"]):
        with pytest.raises(PoolTargetError):
            parse_targets(bad)


def test_plan_moves_toward_the_target_in_bounded_steps():
    bounds = Bounds(min_replicas=1, max_replicas=6, max_step=2)
    changes = plan({"paged": 5, "prefix": 2}, {"engine-paged": 1, "engine-prefix": 2}, DEPLOYMENTS, bounds)
    assert changes == [ScaleChange("paged", "engine-paged", 1, 3, 5)]  # +2 this round, prefix already right
    # clamped to the bounds: a target of 0 keeps min_replicas, 40 stops at max_replicas
    changes = plan({"paged": 0, "prefix": 40}, {"engine-paged": 2, "engine-prefix": 5}, DEPLOYMENTS, bounds)
    assert [(c.deployment, c.desired) for c in changes] == [("engine-paged", 1), ("engine-prefix", 6)]


def test_plan_leaves_alone_what_it_knows_nothing_about():
    bounds = Bounds()
    assert plan({"prefix": 4}, {"engine-paged": 1, "engine-prefix": 4}, DEPLOYMENTS, bounds) == []
    # a Deployment whose scale could not be read is not touched
    assert plan({"paged": 4}, {}, DEPLOYMENTS, bounds) == []
    assert plan({"sim": 9}, {"engine-paged": 1}, DEPLOYMENTS, bounds) == []


def test_bounds_and_deployment_flags_are_checked():
    with pytest.raises(ValueError):
        Bounds(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        Bounds(max_step=0)
    assert parse_deployments(None) == DEPLOYMENTS
    assert parse_deployments(["paged=gpu-paged"]) == {"paged": "gpu-paged"}
    with pytest.raises(ValueError, match="KIND=NAME"):
        parse_deployments(["engine-paged"])


def test_the_request_the_kubernetes_client_sends():
    from kubernetes.client import ApiClient, AppsV1Api, Configuration

    config = Configuration()
    config.host = "https://cluster.invalid:6443"
    api = AppsV1Api(ApiClient(config))
    scales = DeploymentScales("duet", apps_api=api)
    kwargs = scales.patch_args(ScaleChange("prefix", "engine-prefix", 2, 4, 7))
    method, url, headers, body, _ = api._patch_namespaced_deployment_scale_serialize(
        **kwargs, pretty=None, dry_run=None, field_validation=None, force=None, _request_auth=None,
        _headers=None, _host_index=0)
    assert method == "PATCH"
    assert url == ("https://cluster.invalid:6443/apis/apps/v1/namespaces/duet/deployments/engine-prefix/scale"
                   "?fieldManager=duet-pool-scaler")
    # the client's default for a dict body is a JSON *Patch*, which the API server would reject for this body
    assert headers["Content-Type"] == MERGE_PATCH
    assert body == {"spec": {"replicas": 4}}


def test_cli_without_a_cluster_says_so():
    out = subprocess.run([sys.executable, "-m", "duet.cli", "deploy", "scale-pools", "--gateway",
                          "http://127.0.0.1:9", "--dry-run", "--once"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False, env={"PATH": "/usr/bin:/bin", "KUBECONFIG": "/nonexistent",
                                                     "HOME": "/nonexistent", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr
    assert "no Kubernetes credentials" in out.stdout
