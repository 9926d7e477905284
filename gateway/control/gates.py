"""Migration gates: may a candidate take live traffic? One pure check, used twice.

`duet migrate canary` (the admin API's canary start, gateway/control/admin.py) asks it of the shadow's
figures (gateway/control/shadow.py: the candidate's answers to mirrored requests against the primary's
answers to the same requests); the rollback controller (gateway/control/rollback.py) asks it again of the
live figures of the canary arm against the baseline arm during the ramp, so the bounds that let a
candidate in are the bounds that keep it in.

    Gates    the configured bounds (each None: not checked)
    Figures  what one side measured over a window: requests, errors, TTFT and TPOT p50/p99, greedy
             answers compared with the primary's and how many agreed
    check    (gates, candidate, primary) -> Verdict: passed, enough data, and one line per failed bound
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# each ratio bound: the candidate's figure over the primary's, at most this
RATIO_FIGURES = {
    "max_ttft_p50_ratio": "ttft_p50_s", "max_ttft_p99_ratio": "ttft_p99_s",
    "max_tpot_p50_ratio": "tpot_p50_s", "max_tpot_p99_ratio": "tpot_p99_s",
}


class GateError(ValueError):
    """Gates that cannot be applied (unknown field, bad bound): a 400 on the admin API."""


@dataclass(frozen=True)
class Gates:
    min_requests: int = 20  # on each side before any verdict
    max_ttft_p50_ratio: float | None = 1.5
    max_ttft_p99_ratio: float | None = 2.0
    max_tpot_p50_ratio: float | None = 1.5
    max_tpot_p99_ratio: float | None = 2.0
    max_error_rate_increase: float | None = 0.02  # candidate error rate minus the primary's
    min_greedy_agreement: float | None = 0.9  # share of greedy answers identical to the primary's
    min_greedy_compared: int = 5  # greedy pairs needed before agreement is judged

    @classmethod
    def from_dict(cls, d: dict | None) -> Gates:
        """From JSON; missing fields keep their defaults, an explicit null turns a bound off."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise GateError("gates must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise GateError(f"unknown gate(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        values = {}
        for name, value in d.items():
            if name in ("min_requests", "min_greedy_compared"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise GateError(f"gates.{name} must be an integer >= 1, got {value!r}")
            elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                        or not math.isfinite(value)):
                raise GateError(f"gates.{name} must be a finite number or null, got {value!r}")
            values[name] = value if value is None or name in ("min_requests", "min_greedy_compared") \
                else float(value)
        gates = cls(**values)
        for name in RATIO_FIGURES:
            bound = getattr(gates, name)
            if bound is not None and bound <= 0:
                raise GateError(f"gates.{name} must be > 0, got {bound}")
        for name in ("max_error_rate_increase", "min_greedy_agreement"):
            bound = getattr(gates, name)
            if bound is not None and not 0 <= bound <= 1:
                raise GateError(f"gates.{name} must be within 0..1, got {bound}")
        return gates

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Figures:
    """One side's figures over a window; latency fields None when no request had one."""

    requests: int = 0
    errors: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    greedy_compared: int = 0
    greedy_agreed: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def greedy_agreement(self) -> float | None:
        return self.greedy_agreed / self.greedy_compared if self.greedy_compared else None

    def to_dict(self) -> dict:
        ms = {k: None if v is None else round(v * 1000.0, 3) for k, v in (
            ("ttft_p50_ms", self.ttft_p50_s), ("ttft_p99_ms", self.ttft_p99_s),
            ("tpot_p50_ms", self.tpot_p50_s), ("tpot_p99_ms", self.tpot_p99_s))}
        return {"requests": self.requests, "errors": self.errors, "error_rate": self.error_rate, **ms,
                "greedy_compared": self.greedy_compared, "greedy_agreement": self.greedy_agreement}


@dataclass(frozen=True)
class Verdict:
    passed: bool  # enough data and no bound failed
    enough_data: bool
    failures: tuple[str, ...]  # one line per failed bound, e.g. "TTFT p50 3.1x the primary's (bound 1.5x)"
    waiting_for: str = ""  # what is missing when not enough_data

    def to_dict(self) -> dict:
        return {"passed": self.passed, "enough_data": self.enough_data, "failures": list(self.failures),
                "waiting_for": self.waiting_for}


def check(gates: Gates, candidate: Figures, primary: Figures) -> Verdict:
    """Does the candidate pass every configured bound against the primary? Pure.

    Failures are reported as soon as the request counts allow (a failed bound is never hidden behind a
    missing one); `passed` needs every configured bound to have its data."""
    missing = []
    if candidate.requests < gates.min_requests or primary.requests < gates.min_requests:
        missing.append(f"{gates.min_requests} requests on each side (candidate {candidate.requests}, "
                       f"primary {primary.requests})")
        return Verdict(False, False, (), "; ".join(missing))
    failures = []
    if gates.max_error_rate_increase is not None:
        diff = candidate.error_rate - primary.error_rate
        if diff > gates.max_error_rate_increase:
            failures.append(f"error rate {candidate.error_rate:.1%} vs the primary's {primary.error_rate:.1%} "
                            f"(bound +{gates.max_error_rate_increase:.1%})")
    for bound_name, figure in RATIO_FIGURES.items():
        bound = getattr(gates, bound_name)
        if bound is None:
            continue
        c, p = getattr(candidate, figure), getattr(primary, figure)
        label = figure.removesuffix("_s").replace("_", " ").upper().replace("P50", "p50").replace("P99", "p99")
        if c is None or not p:
            missing.append(label)
            continue
        if c / p > bound:
            failures.append(f"{label} {c / p:.2f}x the primary's ({c * 1000:.1f} vs {p * 1000:.1f} ms; "
                            f"bound {bound:g}x)")
    if gates.min_greedy_agreement is not None:
        agreement = candidate.greedy_agreement
        if candidate.greedy_compared < gates.min_greedy_compared or agreement is None:
            missing.append(f"{gates.min_greedy_compared} greedy answers compared (have {candidate.greedy_compared})")
        elif agreement < gates.min_greedy_agreement:
            failures.append(f"greedy agreement {agreement:.0%} of {candidate.greedy_compared} "
                            f"(bound {gates.min_greedy_agreement:.0%})")
    enough = not missing
    return Verdict(enough and not failures, enough, tuple(failures), "; ".join(missing))
