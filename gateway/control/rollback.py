"""Automatic canary analysis: roll a misbehaving canary back to weight 0, walk a healthy one up a ramp.

Per model, an optional `CanaryPolicy` names the canary and baseline variants and the bounds: the canary's
TTFT p99 may be at most `max_ttft_p99_ratio` times the baseline's, and its error rate at most
`max_error_rate_increase` above the baseline's, both measured over the last `window_s` seconds and only once
the canary has `min_requests` requests in that window. When the canary stays outside the bounds for
`confirm_s` seconds in a row, the controller sets its weight to 0 through the StateStore (so every replica
applies it), writes an audit entry (its actor) such as "automatic rollback: TTFT p99 2.4x baseline over 120 s",
counts `duet_canary_rollbacks_total`, and keeps the event for the dashboard.

A ramp is a list of (weight, hold_s) steps: the canary's share in percent (the baseline gets the rest).
While the canary stays healthy the controller applies step i+1 once step i has held for its hold time;
a rollback stops the ramp. A last step of 100% that holds for its hold time promotes the canary: audited
("canary promoted"), kept as an event, and the controller stops watching that model.

A policy may carry the shadow's gates (gateway/control/gates.py; `duet migrate canary` copies them from the
shadow that let the canary start): then the same bounds (TTFT and TPOT p50/p99 ratios, error rate, greedy
agreement from the shadow run while it still mirrors) are checked on the live canary arm against the
baseline arm throughout the ramp, and a failed bound is a breach like the two above. `judge` is pure; `RollbackController.tick(now)` does the I/O; the gateway's lifespan ticks it once a second
(gateway/app.py; tests call `tick` with their own clock).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from gateway.control.gates import Figures, GateError, Gates, check
from gateway.control.stats import RequestStats, WindowStats
from gateway.ticks import sleep_to_tick

log = logging.getLogger("duet.gateway.rollback")



def rollback_metrics(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """The controller's counters, registered in the gateway's registry (so /metrics shows them)."""
    return (
        Counter("duet_canary_rollbacks", "Automatic canary rollbacks (canary weight set to 0)",
                ("model", "variant"), registry=registry),
        Counter("duet_canary_ramp_steps", "Canary ramp steps applied automatically",
                ("model", "variant"), registry=registry),
    )


class PolicyError(ValueError):
    """A canary policy that cannot be applied (bad bounds, unknown variants): becomes a 400."""


@dataclass(frozen=True)
class RampStep:
    weight: float  # canary share in percent, 0..100
    hold_s: float


@dataclass(frozen=True)
class CanaryPolicy:
    model: str
    canary: str
    baseline: str
    window_s: float = 120.0
    min_requests: int = 20
    max_ttft_p99_ratio: float | None = 2.0
    max_error_rate_increase: float | None = 0.05
    confirm_s: float = 10.0
    ramp: tuple[RampStep, ...] = ()
    gates: Gates | None = None  # the shadow's gates, checked again on the live arms during the ramp

    @classmethod
    def from_dict(cls, model: str, d: dict) -> CanaryPolicy:
        """Build from JSON/YAML; raises PolicyError naming the bad field."""
        if not isinstance(d, dict):
            raise PolicyError("the canary policy must be an object")
        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = set(d) - known
        if unknown:
            raise PolicyError(f"unknown canary policy field(s): {', '.join(sorted(unknown))}")
        for name in ("canary", "baseline"):
            if not isinstance(d.get(name), str) or not d[name]:
                raise PolicyError(f"canary policy needs '{name}': the variant name")
        try:
            ramp = tuple(RampStep(float(s["weight"]), float(s["hold_s"])) for s in d.get("ramp") or ())
        except (KeyError, TypeError, ValueError) as e:
            raise PolicyError(f"ramp steps must be objects with numeric 'weight' and 'hold_s' ({e})") from None
        try:
            gates = None if d.get("gates") is None else Gates.from_dict(d["gates"])
        except GateError as e:
            raise PolicyError(str(e)) from None
        try:
            policy = cls(
                model=model, canary=d["canary"], baseline=d["baseline"],
                window_s=float(d.get("window_s", cls.window_s)),
                min_requests=int(d.get("min_requests", cls.min_requests)),
                max_ttft_p99_ratio=_opt_float(d.get("max_ttft_p99_ratio", cls.max_ttft_p99_ratio)),
                max_error_rate_increase=_opt_float(d.get("max_error_rate_increase", cls.max_error_rate_increase)),
                confirm_s=float(d.get("confirm_s", cls.confirm_s)),
                ramp=ramp, gates=gates,
            )
        except (TypeError, ValueError) as e:
            raise PolicyError(f"bad canary policy value: {e}") from None
        policy.validate()
        return policy

    def validate(self) -> None:
        # NaN passes every range check below and Infinity breaks the JSON the admin API answers with
        numbers = [self.window_s, self.confirm_s, self.max_ttft_p99_ratio, self.max_error_rate_increase,
                   *(x for step in self.ramp for x in (step.weight, step.hold_s))]
        if not all(v is None or math.isfinite(v) for v in numbers):
            raise PolicyError("canary policy numbers must be finite")
        if self.canary == self.baseline:
            raise PolicyError("canary and baseline must be different variants")
        if self.window_s <= 0 or self.confirm_s < 0 or self.min_requests < 1:
            raise PolicyError("window_s must be > 0, confirm_s >= 0 and min_requests >= 1")
        if self.max_ttft_p99_ratio is not None and self.max_ttft_p99_ratio <= 0:
            raise PolicyError("max_ttft_p99_ratio must be > 0")
        if self.max_error_rate_increase is not None and not 0 <= self.max_error_rate_increase <= 1:
            raise PolicyError("max_error_rate_increase must be within 0..1")
        for step in self.ramp:
            if not 0 <= step.weight <= 100 or step.hold_s < 0:
                raise PolicyError("ramp step weight must be within 0..100 and hold_s >= 0")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("model")
        d["ramp"] = [dataclasses.asdict(s) for s in self.ramp]
        d["gates"] = None if self.gates is None else self.gates.to_dict()
        return d


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class Verdict:
    breach: bool
    message: str  # why, for the audit log; "" when healthy or not enough data
    enough_data: bool


def judge(policy: CanaryPolicy, canary: WindowStats, baseline: WindowStats,
          greedy: tuple[int, int] = (0, 0)) -> Verdict:
    """Is the canary outside its bounds over this window? Pure.

    Needs `min_requests` canary requests. The TTFT check also needs `min_requests` baseline requests with a
    TTFT; the error check compares with the baseline's rate when it has enough requests, else with 0. With
    gates, a bound the gates' own request counts allow to judge and that fails is a breach; `greedy` is the
    shadow's (compared, agreed) over the window."""
    if canary.count < policy.min_requests:
        return Verdict(False, "", False)
    span = f"over {policy.window_s:g} s"
    base_ok = baseline.count >= policy.min_requests
    if policy.max_error_rate_increase is not None:
        base_rate = baseline.error_rate if base_ok else 0.0
        if canary.error_rate - base_rate > policy.max_error_rate_increase:
            return Verdict(True, f"error rate {canary.error_rate:.0%} vs baseline {base_rate:.0%} {span}", True)
    if (
        policy.max_ttft_p99_ratio is not None and base_ok
        and canary.ttft_p99_s is not None and baseline.ttft_p99_s
    ):
        ratio = canary.ttft_p99_s / baseline.ttft_p99_s
        if ratio > policy.max_ttft_p99_ratio:
            return Verdict(True, f"TTFT p99 {ratio:.1f}x baseline {span}", True)
    if policy.gates is not None:
        gated = check(policy.gates, _figures(canary, greedy), _figures(baseline))
        if gated.failures:
            return Verdict(True, f"gate failed {span}: {'; '.join(gated.failures)}", True)
    return Verdict(False, "", True)


def _figures(w: WindowStats, greedy: tuple[int, int] = (0, 0)) -> Figures:
    """A live arm's window as the gates read it (a request's TPOT is its mean inter-token gap)."""
    return Figures(requests=w.count, errors=w.errors, ttft_p50_s=w.ttft_p50_s, ttft_p99_s=w.ttft_p99_s,
                   tpot_p50_s=w.itl_p50_s, tpot_p99_s=w.itl_p99_s, greedy_compared=greedy[0],
                   greedy_agreed=greedy[1])


def with_weights(config, weights: dict[str, float]):
    """A copy of a RoutingConfig with the named variants' weights replaced (others unchanged)."""
    variants = tuple(
        dataclasses.replace(v, weight=float(weights[v.name])) if v.name in weights else v
        for v in config.variants
    )
    return dataclasses.replace(config, variants=variants)


@dataclass
class _ModelState:
    breach_since: float | None = None
    rolled_back: bool = False
    promoted: bool = False
    ramp_index: int = -1  # -1: ramp not started
    step_since: float = 0.0


@dataclass
class RollbackController:
    """Applies the policies against `stats`, writing changes through `store` (a gateway StateStore).
    Pass the gateway's metrics registry as `registry` (a private one is made otherwise)."""

    store: object
    stats: RequestStats
    registry: CollectorRegistry | None = None
    shadow: object | None = None  # gateway.control.shadow.ShadowLedger: greedy agreement for gated policies
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    policies: dict[str, CanaryPolicy] = field(default_factory=dict)
    events: deque = field(default_factory=lambda: deque(maxlen=100))
    _state: dict[str, _ModelState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.registry is None:
            self.registry = CollectorRegistry()
        self.rollbacks_total, self.ramp_steps_total = rollback_metrics(self.registry)

    def set_policy(self, policy: CanaryPolicy | None, model: str | None = None) -> None:
        """Install (or with None, remove) a model's policy; resets its rollback and ramp state."""
        name = policy.model if policy is not None else model
        self._state.pop(name, None)
        if policy is None:
            self.policies.pop(name, None)
        else:
            policy.validate()
            self.policies[name] = policy

    def status(self, model: str) -> dict:
        st = self._state.get(model, _ModelState())
        return {"rolled_back": st.rolled_back, "promoted": st.promoted, "ramp_step": st.ramp_index,
                "breaching": st.breach_since is not None}

    async def run(self, interval_s: float = 1.0) -> None:
        """`tick` every `interval_s` (the gateway's lifespan task)."""
        while True:
            await sleep_to_tick(interval_s)
            await self.tick()

    async def tick(self, now: float | None = None) -> None:
        """Evaluate every policy once; failures of one model are logged and do not stop the others."""
        now = self.clock() if now is None else now
        for model, policy in list(self.policies.items()):
            try:
                await self._tick_model(model, policy, now)
            except Exception:  # a Redis hiccup must not kill the loop; the next tick retries
                log.exception("canary analysis for %s failed", model)

    async def _tick_model(self, model: str, policy: CanaryPolicy, now: float) -> None:
        st = self._state.setdefault(model, _ModelState())
        if st.rolled_back or st.promoted:
            return
        canary = self.stats.window(policy.window_s, model=model, variant=policy.canary)
        baseline = self.stats.window(policy.window_s, model=model, variant=policy.baseline)
        greedy = self.shadow.agreement(model, policy.window_s) if self.shadow is not None else (0, 0)
        verdict = judge(policy, canary, baseline, greedy)
        if verdict.breach:
            if st.breach_since is None:
                st.breach_since = now
            if now - st.breach_since >= policy.confirm_s:
                await self._rollback(model, policy, verdict.message)
                st.rolled_back = True
            return
        st.breach_since = None
        await self._ramp(model, policy, st, now)

    async def _rollback(self, model: str, policy: CanaryPolicy, why: str) -> None:
        config = await self.store.get_routing(model)
        message = f"automatic rollback: {why}"
        if config is not None and any(v.name == policy.canary for v in config.variants):
            weights = {policy.canary: 0.0}
            base = next((v for v in config.variants if v.name == policy.baseline), None)
            others = sum(v.weight for v in config.variants if v.name != policy.canary)
            if base is not None and others <= 0:
                weights[policy.baseline] = 100.0  # keep a positive sum
            await self.store.put_routing(model, with_weights(config, weights), message)
        self.rollbacks_total.labels(model, policy.canary).inc()
        self.events.append({"at": self.wall_clock(), "model": model, "variant": policy.canary, "message": message})
        log.warning("%s: %s", model, message)

    async def _ramp(self, model: str, policy: CanaryPolicy, st: _ModelState, now: float) -> None:
        if not policy.ramp:
            return
        started = st.ramp_index >= 0
        if started and now - st.step_since < policy.ramp[st.ramp_index].hold_s:
            return  # the current step has not held long enough
        if started and st.ramp_index + 1 >= len(policy.ramp):
            if policy.ramp[-1].weight >= 100:
                await self._promote(model, policy, st)
            return  # the last step held: promoted when it gives the canary everything
        step_index = st.ramp_index + 1
        config = await self.store.get_routing(model)
        if config is None:
            return
        weight = policy.ramp[step_index].weight
        new = with_weights(config, {policy.canary: weight, policy.baseline: 100.0 - weight})
        await self.store.put_routing(
            model, new, f"canary ramp: step {step_index + 1}/{len(policy.ramp)}, canary at {weight:g}%"
        )
        st.ramp_index, st.step_since = step_index, now
        if step_index > 0:
            self.ramp_steps_total.labels(model, policy.canary).inc()

    async def _promote(self, model: str, policy: CanaryPolicy, st: _ModelState) -> None:
        config = await self.store.get_routing(model)
        message = (f"canary promoted: {policy.canary} serves 100% after {len(policy.ramp)} ramp steps "
                   f"within its bounds")
        if config is not None:
            await self.store.put_routing(model, config, message)  # unchanged: the audit log records the event
        st.promoted = True
        self.events.append({"at": self.wall_clock(), "model": model, "variant": policy.canary, "message": message})
        log.info("%s: %s", model, message)
