"""What routing reads and returns: the worker snapshot, the request, the per-model config (with its
validation), the decision, and routing's three typed errors. No policy here: gateway/routing/policy.py is
Duet's policy, gateway/routing/canary.py picks the canary arm, and both take these types.

    NoCapableWorker     no healthy worker can serve the request           -> HTTP 503
    UnknownVariant      the operator's variant override names no variant  -> HTTP 400
    RoutingConfigError  a routing config that cannot be applied           -> HTTP 400 (admin API), ConfigError (file)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from duet.contract import ENGINE_KINDS, HASH_BLOCK_TOKENS
from duet.traffic_classes import GPU, PROFILES

# the route reasons of Duet's policy (a metric label; docs/routing.md explains each)
REASONS = (
    "capability", "affinity", "shed", "prefix_held", "spill", "reuse_high", "reuse_low", "multi_turn",
    "cache_match", "least_load", "override",
)

DEFAULT_VARIANT = "default"


class NoCapableWorker(Exception):
    """No healthy worker can serve this request (maps to HTTP 503)."""


class UnknownVariant(Exception):
    """The operator's variant override names no configured variant (maps to HTTP 400)."""


class RoutingConfigError(ValueError):
    """A routing config that cannot be applied (bad weights, unknown engine kind...)."""


@dataclass(frozen=True)
class WorkerView:
    """A snapshot of one worker as the gateway last saw it."""

    worker_id: str
    model_id: str
    engine_kind: str
    version: str
    capabilities: frozenset[str]
    healthy: bool
    draining: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    queued_prefill_tokens: int = 0  # uncached prompt tokens routed here still before their first token
    # measured rates (0: not measured): prompt tokens prefilled per second (the engine's own figure, else what
    # this gateway saw: gateway/control/pool_tracker.py), and tokens decoded per second by the whole batch
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    # what this gateway learned of its latency model's error on the worker (gateway/routing/calibration.py):
    # observed over predicted TTFT and TPOT of the requests it served lately (1.0: none learned)
    ttft_correction: float = 1.0
    tpot_correction: float = 1.0

    @property
    def load(self) -> int:
        """Requests in flight on the worker (running + queued)."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class Pool:
    """Workers of one engine kind and one deploy version label ("*" matches any version)."""

    engine_kind: str
    version: str = "*"

    def holds(self, w: WorkerView) -> bool:
        return w.engine_kind == self.engine_kind and self.version in ("*", w.version)


@dataclass(frozen=True)
class Variant:
    """One canary arm: a set of pools and its share of the traffic."""

    name: str
    pools: tuple[Pool, ...]
    weight: float


@dataclass(frozen=True)
class RoutingConfig:
    """Per-model routing knobs. Defaults are justified in docs/routing.md."""

    variants: tuple[Variant, ...] = ()  # empty: one implicit variant "default" of all pools
    sticky_key: str = "session"  # "session" | "user": what keeps a client in one canary arm
    reuse_threshold: float = 0.5  # estimated reuse at or above it -> engine_prefix
    overload_running: int = 48  # affinity is dropped at this many requests in flight ...
    overload_kv_usage: float = 0.95  # ... or at this KV usage
    waiting_weight: float = 1.0  # a queued request counts as this many in flight (load = running + w * waiting)
    request_tokens: int = 256  # duet's cost: one request in flight weighs as much as this many prefill tokens
    shed_tokens: int = 98304  # a session leaves its worker when another's prefill wait is shorter by this many tokens
    spill_tokens: int = 4096  # the engine-kind bias: a prompt new to a worker of the other kind costs this much more there
    slo_profile: str = GPU  # the class SLOs (duet/traffic_classes.py) a worker's predicted TTFT and TPOT are held to
    saturation_share: float = 0.5  # a worker is saturated once its predicted TTFT passes this share of the SLO's
    step_tokens: int = 2048  # the engines' token budget per step (max_num_batched_tokens): a prefill's steps, each
    # also decoding the worker's running batch (the predicted TTFT's decode term)

    def validate(self) -> RoutingConfig:
        """Return self, or raise RoutingConfigError with what is wrong."""
        # NaN passes every range check below and Infinity breaks the JSON the admin API answers with
        numbers = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), float)}
        numbers.update({f"variant {v.name!r} weight": v.weight for v in self.variants})
        for name, value in numbers.items():
            if not math.isfinite(value):
                raise RoutingConfigError(f"{name} must be a finite number, got {value}")
        if self.sticky_key not in ("session", "user"):
            raise RoutingConfigError(f"sticky_key must be 'session' or 'user', got {self.sticky_key!r}")
        if not 0.0 <= self.reuse_threshold <= 1.0:
            raise RoutingConfigError(f"reuse_threshold must be in [0, 1], got {self.reuse_threshold}")
        if self.overload_running < 1:
            raise RoutingConfigError(f"overload_running must be >= 1, got {self.overload_running}")
        if min(self.request_tokens, self.shed_tokens, self.spill_tokens) < 0:
            raise RoutingConfigError("request_tokens, shed_tokens and spill_tokens must be >= 0")
        if self.slo_profile not in PROFILES:
            raise RoutingConfigError(f"slo_profile must be one of {', '.join(PROFILES)}, got {self.slo_profile!r}")
        if not 0.0 < self.saturation_share <= 1.0:
            raise RoutingConfigError(f"saturation_share must be in (0, 1], got {self.saturation_share}")
        if self.step_tokens < 1:
            raise RoutingConfigError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.waiting_weight < 0:
            raise RoutingConfigError(f"waiting_weight must be >= 0, got {self.waiting_weight}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise RoutingConfigError(f"variant names must be unique, got {names}")
        for v in self.variants:
            if v.weight < 0 or not v.pools:
                raise RoutingConfigError(f"variant {v.name!r} needs weight >= 0 and at least one pool")
            for p in v.pools:
                if p.engine_kind not in ENGINE_KINDS:
                    raise RoutingConfigError(f"variant {v.name!r}: unknown engine kind {p.engine_kind!r}")
        if self.variants and not any(v.weight > 0 for v in self.variants):
            raise RoutingConfigError("at least one variant needs a positive weight")
        return self


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs to know about one request."""

    model: str
    block_hashes: tuple[int, ...]  # chained hashes of the prompt head (full blocks)
    num_prompt_tokens: int
    session_key: str | None = None
    user_key: str | None = None
    required_capabilities: frozenset[str] = frozenset()
    variant_override: str | None = None
    turn_count: int = 1  # user messages in the chat; > 1 means multi-turn
    sequence: int = 0  # the caller's count of routed requests (ties between equal workers rotate with it)
    block_tokens: int = HASH_BLOCK_TOKENS  # tokens per hashed block (cached blocks -> tokens in duet's cost)
    traffic_class: str = ""  # duet/traffic_classes.py's class ("": none known; no SLO to predict against)


@dataclass(frozen=True)
class RouteDecision:
    """The chosen worker and why. `reason` is the most decisive step (see REASONS);
    `steps` lists every step's outcome, for logs and the simulator."""

    worker_id: str
    engine_kind: str
    variant: str
    reason: str
    estimated_reuse: float
    cached_blocks: int
    steps: tuple[str, ...] = field(default=())
    wanted_kind: str = ""  # the kind step 5 chose, before a spill or a missing kind changed it ("": none)
    predicted_ttft_s: float | None = None  # on the chosen worker, from its measured rates (None: no rate), corrected
    predicted_tpot_s: float | None = None  # ... and its TPOT (None: no decode rate)
    # the latency model's own figures on the chosen worker, before the learned correction: what the gateway
    # compares with what the request saw (gateway/routing/calibration.py)
    modelled_ttft_s: float | None = None
    modelled_tpot_s: float | None = None
