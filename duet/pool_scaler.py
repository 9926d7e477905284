"""`duet deploy scale-pools`: carries the pool planner's target split to the engine Deployments.

The gateway's pool planner decides how many workers of each engine kind the traffic needs; this loop
makes Kubernetes run that many. Each round:

1. `GET {gateway}/admin/pools` with the admin key (DUET_ADMIN_KEY) as a Bearer token. The contract:
   `200 {"target": {"paged": 3, "prefix": 5}}`, a non-negative worker count per engine kind; kinds
   left out have no target this round and are not touched.
2. Read each engine Deployment's current replicas (the `scale` subresource).
3. `plan()`: clamp the target to [--min-replicas, --max-replicas] and move at most --max-step replicas
   per kind per round, so one noisy planner reading cannot empty or flood a pool.
4. PATCH the `scale` subresource (a JSON merge patch `{"spec": {"replicas": N}}`), or with --dry-run
   only print what would change.

A round that fails (gateway unreachable, bad answer, API error) changes nothing and is logged; the loop
goes on. The engine Deployments carry no `replicas` field, so `kubectl apply` never undoes the loop.
The official `kubernetes` client is imported only here (`pip install 'duet[k8s]'`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger("duet.pool_scaler")

DEFAULT_DEPLOYMENTS = {"paged": "engine-paged", "prefix": "engine-prefix"}
FIELD_MANAGER = "duet-pool-scaler"
MERGE_PATCH = "application/merge-patch+json"


class PoolTargetError(ValueError):
    """The gateway's /admin/pools answer is not the documented shape."""


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 16
    max_step: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_step < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_step >= 1")


@dataclass(frozen=True)
class ScaleChange:
    kind: str
    deployment: str
    current: int
    desired: int
    target: int  # what the planner asked for, before bounds and step

    def describe(self) -> str:
        return (f"{self.deployment} ({self.kind}): {self.current} -> {self.desired} replicas "
                f"(planner target {self.target})")


def parse_targets(payload: object) -> dict[str, int]:
    """`{"target": {"paged": 3, "prefix": 5}}` -> {"paged": 3, "prefix": 5}, or PoolTargetError."""
    target = payload.get("target") if isinstance(payload, dict) else None
    if not isinstance(target, dict):
        raise PoolTargetError(f'expected {{"target": {{kind: workers}}}}, got {payload!r:.200}')
    for kind, n in target.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise PoolTargetError(f"target for {kind!r} must be a non-negative integer, got {n!r}")
    return dict(target)


def plan(targets: dict[str, int], current: dict[str, int], deployments: dict[str, str],
         bounds: Bounds) -> list[ScaleChange]:
    """The replica changes that move each pool toward its target: pure, so every rule is unit-tested."""
    changes = []
    for kind, name in sorted(deployments.items()):
        if kind not in targets or name not in current:
            continue  # no target for this kind, or its Deployment could not be read: leave it alone
        want = min(max(targets[kind], bounds.min_replicas), bounds.max_replicas)
        have = current[name]
        desired = have + max(-bounds.max_step, min(bounds.max_step, want - have))
        if desired != have:
            changes.append(ScaleChange(kind, name, have, desired, targets[kind]))
    return changes


def scale_patch(replicas: int) -> dict:
    """The body of the PATCH to a Deployment's scale subresource (sent as a JSON merge patch)."""
    return {"spec": {"replicas": replicas}}


def fetch_targets(gateway: str, admin_key: str | None, timeout_s: float = 5.0) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    r = httpx.get(gateway.rstrip("/") + "/admin/pools", headers=headers, timeout=timeout_s)
    if r.status_code != 200:
        raise PoolTargetError(f"GET /admin/pools answered {r.status_code}: {r.text[:200]}")
    return parse_targets(r.json())


class DeploymentScales:
    """Reads and patches the engine Deployments' scale subresource through the official client."""

    def __init__(self, namespace: str, apps_api=None) -> None:
        from kubernetes import client, config

        if apps_api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            apps_api = client.AppsV1Api()
        self.namespace = namespace
        self.apps = apps_api

    def current(self, names: list[str]) -> dict[str, int]:
        out = {}
        for name in names:
            try:
                out[name] = self.apps.read_namespaced_deployment_scale(name, self.namespace).spec.replicas or 0
            except Exception as e:  # noqa: BLE001 - one unreadable Deployment must not stop the others
                log.warning("cannot read the scale of %s/%s: %s", self.namespace, name, e)
        return out

    def patch_args(self, change: ScaleChange) -> dict:
        """Keyword arguments of `patch_namespaced_deployment_scale` for one change."""
        return {"name": change.deployment, "namespace": self.namespace, "body": scale_patch(change.desired),
                "field_manager": FIELD_MANAGER, "_content_type": MERGE_PATCH}

    def apply(self, change: ScaleChange) -> None:
        self.apps.patch_namespaced_deployment_scale(**self.patch_args(change))


def run_round(gateway: str, admin_key: str | None, scales: DeploymentScales, deployments: dict[str, str],
              bounds: Bounds, dry_run: bool) -> list[ScaleChange]:
    targets = fetch_targets(gateway, admin_key)
    changes = plan(targets, scales.current(sorted(deployments.values())), deployments, bounds)
    for change in changes:
        if dry_run:
            print(f"dry run: would scale {change.describe()}", flush=True)
        else:
            scales.apply(change)
            log.info("scaled %s", change.describe())
    return changes


def parse_deployments(entries: list[str] | None) -> dict[str, str]:
    if not entries:
        return dict(DEFAULT_DEPLOYMENTS)
    out = {}
    for e in entries:
        kind, sep, name = e.partition("=")
        if not sep or not kind or not name:
            raise ValueError(f"--deployment takes KIND=NAME, got {e!r}")
        out[kind] = name
    return out


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        deployments = parse_deployments(args.deployment)
        bounds = Bounds(args.min_replicas, args.max_replicas, args.max_step)
    except ValueError as e:
        print(f"duet deploy scale-pools: {e}")
        return 2
    try:
        scales = DeploymentScales(args.namespace)
    except ImportError:
        print("duet deploy scale-pools needs the kubernetes client: pip install 'duet[k8s]'")
        return 2
    except Exception as e:  # noqa: BLE001 - no in-cluster config and no kubeconfig
        print(f"duet deploy scale-pools: no Kubernetes credentials (in-cluster or kubeconfig): {e}")
        return 2
    admin_key = os.environ.get("DUET_ADMIN_KEY")
    # as PID 1 in its pod, SIGTERM without a handler would be ignored until the grace period's SIGKILL
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    while True:
        try:
            run_round(args.gateway, admin_key, scales, deployments, bounds, args.dry_run)
        except (httpx.HTTPError, PoolTargetError, ValueError) as e:
            log.warning("round skipped, nothing changed: %s", e)
            if args.once:
                return 1
        except Exception as e:  # noqa: BLE001 - the Kubernetes API failed: try again next round
            log.warning("round failed: %s", e)
            if args.once:
                return 1
        if args.once:
            return 0
        time.sleep(args.interval)
