"""The gateway config file (YAML), read once at start into frozen dataclasses.

Format (docs/operations.md has the full reference; deploy/gateway.yaml is an example):

    host: 0.0.0.0
    port: 8000
    models:                       # each model the gateway serves: its tokenizer and chat template
      - path: /models/qwen3-0.6b  # model directory; its id (dir name) is the API "model"
    workers:                      # static workers (more may register themselves in Redis)
      - address: 10.0.0.5:50051
    backends:                     # external vLLM / SGLang / OpenAI servers as pools (gateway/backends/backend_spec.py)
      - {engine: vllm, url: http://10.0.0.7:8000, kv_events: {endpoint: tcp://10.0.0.7:5557}}
    redis: redis://redis:6379/0   # optional; default: in-process state (one gateway)
    auth:
      api_keys: [sk-a, {key: sk-b, cache_salt: tenant-b}]   # optional; none: /v1 is open
                                  # an entry may add requests_per_minute, tokens_per_minute, max_concurrent,
                                  # models (gateway/control/limits.py); default_key_limits applies to every key
      admin_key: adm-secret
    limits: {max_body_bytes: 4194304, max_pending_requests: 4096, max_attempts: 3, default_max_tokens: null,
             max_queue_wait_s: 900}   # admission control (gateway/serving/admission.py); null: never refuse on wait
    health: {poll_interval_s: 1.0, idle_poll_s: 5.0}   # idle_poll_s: an HTTP backend with no work, polled this often
    hashing: {max_blocks: 256}
    affinity_ttl_s: 600
    routing: {reuse_threshold: 0.5, ...}    # defaults of gateway.routing.route_types.RoutingConfig
    routing_policy: null          # "module:factory" of a policy run instead of Duet's (the benchmarks'
                                  # baselines, loadtests/sim/routing/baselines.py; docs/routing.md)
    pool_planner: {cooldown_s: 30, ...}     # defaults of gateway.control.pool_planner.PlannerConfig
    tracing: {enabled: false}
    timeouts: {first_token_s: 120, stall_s: 30, ...}   # gateway.serving.timeouts.Timeouts (null: no limit)
    profile: {enabled: true}      # the live workload profile (gateway/control/profile.py)
    gc: {freeze: true, gen0_threshold: 10000}   # the process's cyclic-GC policy (gateway/gc_policy.py)
    capture: {enabled: false, sample_rate: 1.0, max_records: 100000, max_age_s: null, models: []}
                                  # the privacy-safe traffic capture (gateway/control/capture.py); off by default
    shadow:                       # per model, a shadow run (PUT /admin/models/MODEL/shadow's body), shared by
      MODEL: {pools: [{engine_kind: paged, version: v2}], share: 0.1, max_concurrency: 4, gates: {...}}
                                  # every replica through the state store (gateway/control/shadow_sync.py)

Environment `DUET_API_KEYS` (comma separated) and `DUET_ADMIN_KEY` add to / override `auth`;
`DUET_REDIS_URL` overrides `redis` (a URL with a password can then come from a Secret).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from gateway.backends.backend_spec import BackendSpec, BackendSpecError, parse_backends
from gateway.control.capture import CaptureConfig
from gateway.control.limits import KeyLimits, parse_key_limits
from gateway.control.pool_planner import PlannerConfig
from gateway.gc_policy import GcPolicy
from gateway.routing.route_types import Pool, RoutingConfig, RoutingConfigError, Variant
from gateway.serving.timeouts import Timeouts


class ConfigError(ValueError):
    """The config file is unreadable or has a bad value (the message names it)."""


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024
    max_pending_requests: int = 4096  # requests inside the gateway at once; beyond -> 429
    max_attempts: int = 3  # workers tried for one request when they fail before the first token
    default_max_tokens: int | None = None  # None: up to the context length, as OpenAI does
    # estimated engine-queue wait above which a request is refused at once (429 + Retry-After); None:
    # never. A CPU deployment queues long documents for minutes; an SDK client's own timeout (600 s by
    # default, sent with each request) bounds its wait further, so this cuts only clients that send none
    max_queue_wait_s: float | None = 900.0

    def __post_init__(self) -> None:
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ValueError(f"limits.max_queue_wait_s must be > 0 (or null for no bound), got {self.max_queue_wait_s}")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_paths: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    backends: tuple[BackendSpec, ...] = ()  # external engine servers (gateway/backends/http_backend.py)
    redis: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> cache_salt ("" = shared cache)
    key_limits: dict[str, KeyLimits] = field(default_factory=dict)  # key id (limits.api_key_id) -> limits
    admin_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    poll_interval_s: float = 1.0
    idle_poll_s: float = 5.0  # an HTTP backend with no work is polled this often (gateway/backends/http_backend.py)
    max_hash_blocks: int = 256
    affinity_ttl_s: float = 600.0  # a session sticks to its worker this long after its last request
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    routing_policy: str | None = None  # None: gateway.routing.policy.route; else "module:factory" (load_routing_policy)
    tracing: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)
    pool_planner: PlannerConfig = field(default_factory=PlannerConfig)
    profile: bool = True  # the live workload profile (gateway/control/profile.py)
    capture: CaptureConfig = field(default_factory=CaptureConfig)  # the traffic capture (gateway/control/capture.py)
    # model -> its shadow run (ShadowConfig.to_dict(), validated): seeds the state store's (gateway/control/shadow_sync.py)
    shadow: dict[str, dict] = field(default_factory=dict)
    gc: GcPolicy = field(default_factory=GcPolicy)  # `duet gateway`'s cyclic-GC policy (gateway/gc_policy.py)


def _section(raw: dict, name: str) -> dict:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"'{name}' must be a mapping")
    return value


def _known(cls, values: dict, where: str) -> dict:
    names = {f.name for f in fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    return values


def parse_api_keys(entries) -> dict[str, str]:
    keys: dict[str, str] = {}
    for e in entries or ():
        if isinstance(e, str) and e:
            keys[e] = ""
        elif isinstance(e, dict) and isinstance(e.get("key"), str):
            keys[e["key"]] = str(e.get("cache_salt") or "")
        else:
            raise ConfigError(f"auth.api_keys entries are strings or {{key, cache_salt}}, got {e!r}")
    return keys


def routing_from_dict(d: dict) -> RoutingConfig:
    d = dict(d)
    variants = tuple(
        Variant(name=v["name"], weight=float(v.get("weight", 1.0)),
                pools=tuple(Pool(engine_kind=p["engine_kind"], version=str(p.get("version", "*")))
                            for p in v.get("pools", ())))
        for v in d.pop("variants", ()) or ()
    )
    try:
        return RoutingConfig(variants=variants, **_known(RoutingConfig, d, "routing")).validate()
    except (RoutingConfigError, TypeError, KeyError) as e:
        raise ConfigError(f"routing: {e}") from None


@dataclass(frozen=True)
class _Switch:
    enabled: bool = True  # a section whose one key turns its feature on or off


def shadow_from_dict(d: dict) -> dict[str, dict]:
    """`shadow:` {model: the admin API's PUT .../shadow body}, each checked as that endpoint checks it."""
    from gateway.control.shadow import ShadowConfig, ShadowError, ShadowLedger

    out = {}
    for model, body in d.items():
        try:
            out[str(model)] = ShadowConfig.from_dict(str(model), body, ShadowLedger.MAX_WINDOW_S).to_dict()
        except ShadowError as e:
            raise ConfigError(f"shadow.{model}: {e}") from None
    return out


def capture_from_dict(d: dict) -> CaptureConfig:
    d = dict(_known(CaptureConfig, d, "capture"))
    if "models" in d:
        d["models"] = tuple(str(m) for m in d["models"] or ())
    return CaptureConfig(**d).validate()


def load_routing_policy(spec: str) -> Callable[[], Callable]:
    """The factory `spec` ("module:name") names. Called once per gateway, it returns a callable with the
    signature of gateway.routing.policy.route, which the gateway then calls in its place: the seam through which
    `duet bench` runs its baseline policies (loadtests/sim/routing/baselines.py) behind a real gateway, while
    the gateway itself holds Duet's policy alone. Raises ConfigError when `spec` names nothing callable."""
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"routing_policy {spec!r}: {e}") from None
    if not callable(factory):
        raise ConfigError(f"routing_policy must be 'module:factory' naming a callable, got {spec!r}")
    return factory


def from_dict(raw: dict, base_dir: Path | None = None) -> GatewayConfig:
    if not isinstance(raw, dict):
        raise ConfigError("the config file must hold a mapping")
    models = []
    for m in raw.get("models") or ():
        path = m.get("path") if isinstance(m, dict) else m
        if not isinstance(path, str):
            raise ConfigError(f"models entries need a 'path', got {m!r}")
        p = Path(os.path.expanduser(path))
        models.append(str(p if p.is_absolute() or base_dir is None else base_dir / p))
    workers = []
    for w in raw.get("workers") or ():
        addr = w.get("address") if isinstance(w, dict) else w
        if not isinstance(addr, str) or ":" not in addr:
            raise ConfigError(f"workers entries need an 'address' host:port, got {w!r}")
        workers.append(addr)
    try:
        backends = parse_backends(raw.get("backends"))
    except BackendSpecError as e:
        raise ConfigError(str(e)) from None
    auth = _section(raw, "auth")
    keys = parse_api_keys(auth.get("api_keys"))
    keys.update(parse_api_keys([k for k in os.environ.get("DUET_API_KEYS", "").split(",") if k]))
    health = _section(raw, "health")
    policy = raw.get("routing_policy")
    if policy is not None:
        load_routing_policy(str(policy))
    try:
        return GatewayConfig(
            host=str(raw.get("host", "127.0.0.1")),
            port=int(raw.get("port", 8000)),
            model_paths=tuple(models),
            workers=tuple(workers),
            backends=backends,
            redis=os.environ.get("DUET_REDIS_URL") or raw.get("redis") or None,
            api_keys=keys,
            key_limits=parse_key_limits(auth.get("api_keys"), auth.get("default_key_limits")),
            admin_key=os.environ.get("DUET_ADMIN_KEY") or auth.get("admin_key") or None,
            limits=Limits(**_known(Limits, _section(raw, "limits"), "limits")),
            poll_interval_s=float(health.get("poll_interval_s", 1.0)),
            idle_poll_s=float(health.get("idle_poll_s", 5.0)),
            max_hash_blocks=int(_section(raw, "hashing").get("max_blocks", 256)),
            affinity_ttl_s=float(raw.get("affinity_ttl_s", 600.0)),
            routing=routing_from_dict(_section(raw, "routing")),
            routing_policy=None if policy is None else str(policy),
            tracing=bool(_section(raw, "tracing").get("enabled", False)),
            timeouts=Timeouts(**_known(Timeouts, _section(raw, "timeouts"), "timeouts")).validate(),
            pool_planner=PlannerConfig(**_known(PlannerConfig, _section(raw, "pool_planner"),
                                                "pool_planner")).validate(),
            profile=bool(_known(_Switch, _section(raw, "profile"), "profile").get("enabled", True)),
            capture=capture_from_dict(_section(raw, "capture")),
            shadow=shadow_from_dict(_section(raw, "shadow")),
            gc=GcPolicy(**_known(GcPolicy, _section(raw, "gc"), "gc")).validate(),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def load(path: str | Path) -> GatewayConfig:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read gateway config {p}: {e}") from None
    return from_dict(raw or {}, base_dir=p.parent)
