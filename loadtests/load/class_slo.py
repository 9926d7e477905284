"""Per-class SLO sets of the benchmarks and the fleet simulator, their bounds read from the one traffic-class
table (duet/traffic_classes.py: the classes, which table class each benchmark and fleet class is, each bound
with its reason).

    ClassSlo(bounds, default)                              a bound per class name; `met(record)` duck-types
                                                           loadtests/load/report.Slo (summarize takes it)
    CLASS_SLOS                                             the class benchmarks' classes at the table's `cpu`
                                                           profile (`duet bench classes`, `compare --pin-cores`)
    FLEET_SLOS["h200" | "h200-70b" | "cpu"]                the fleet simulator's classes at its cost model's
                                                           profile (COST_MODEL_PROFILES)
    parse_class_slos("long_doc=20000,chat.tpot=100", base) overrides, milliseconds (or `3s`)

A request meets its class's bound when its TTFT is within `ttft_ms` (+ `ttft_ms_per_prompt_token` a prompt
token) and its TPOT (mean time per output token after the first; `itl_ms`, the name the benchmarks' JSON has
always printed) within `itl_ms`. Every bound is in milliseconds; only the measured figures the reports print
beside them keep their own units. An override names one benchmark or fleet class (multi_turn and agent are
both the table's `session`, and overriding one leaves the other as it was). A class the table does not name
(trace replays) gets `UNCLASSIFIED`, compare's old single SLO, 5 s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from duet.traffic_classes import BENCH_CLASSES, CPU, FLEET_CLASSES, GPU, UNCLASSIFIED, ClassBound, bound_of

if TYPE_CHECKING:  # the fleet simulator imports this module without the HTTP client
    from loadtests.load.client import RequestRecord

COST_MODEL_PROFILES = {"h200": GPU, "h200-70b": GPU, "cpu": CPU}  # the fleet's cost models: the hardware they model


def bounds_at(names: Iterable[str], profile: str) -> dict[str, ClassBound]:
    """Each name's bound in the table at `profile`."""
    return {name: bound_of(name, profile) for name in names}


CLASS_SLOS = bounds_at(BENCH_CLASSES, CPU)


@dataclass(frozen=True)
class ClassSlo:
    bounds: dict[str, ClassBound] = field(default_factory=lambda: dict(CLASS_SLOS))
    default: ClassBound = UNCLASSIFIED  # a class the table does not name
    ttft_ms = None  # report.summarize prints one bound; there is none (describe() has them all)
    itl_ms = None

    def bound(self, traffic_class: str) -> ClassBound:
        return self.bounds.get(traffic_class, self.default)

    def met(self, r: RequestRecord) -> bool:
        return self.bound(r.traffic_class).met(r)

    def describe(self, classes: Iterable[str]) -> dict:
        return {c: self.bound(c).describe() for c in classes}


FLEET_SLOS = {cost_model: ClassSlo(bounds_at(FLEET_CLASSES, profile))
              for cost_model, profile in COST_MODEL_PROFILES.items()}

_FORM = "CLASS=TTFT_MS, CLASS.ttft=MS or CLASS.tpot=MS (milliseconds, or seconds with an s: 3s)"


def _ms(value: str) -> float:
    text = value.strip().lower()
    scale = 1.0
    if text.endswith("ms"):
        text = text[:-2]
    elif text.endswith("s"):
        text, scale = text[:-1], 1000.0
    try:
        ms = float(text) * scale
    except ValueError:
        raise ValueError(f"expected {_FORM}") from None
    if not ms > 0:
        raise ValueError("the bound must be > 0")
    return ms


def parse_class_slos(text: str | None, base: ClassSlo | None = None, classes: Iterable[str] | None = None,
                     flag: str = "--class-slo") -> ClassSlo:
    """`base` (default CLASS_SLOS) with the bounds `text` names replaced, in milliseconds:
    'long_doc=20000,multi_turn.tpot=100,chat.ttft=3s'. `classes`: the only class names allowed; `flag` names
    the option in the errors."""
    base = base or ClassSlo()
    allowed = tuple(classes) if classes is not None else None
    bounds = dict(base.bounds)
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, value = part.partition("=")
        name, _, what = key.strip().partition(".")
        try:
            if not eq or not name or what not in ("", "ttft", "tpot"):
                raise ValueError(f"expected {_FORM}")
            if allowed is not None and name not in allowed:
                raise ValueError(f"unknown class {name!r} (classes: {', '.join(allowed)})")
            ms = _ms(value)
        except ValueError as e:
            raise ValueError(f"{flag}: {part!r}: {e}") from None
        old = bounds.get(name, base.default)
        bounds[name] = (ClassBound(old.ttft_ms, ms, old.ttft_ms_per_prompt_token) if what == "tpot"
                        else ClassBound(ms, old.itl_ms, old.ttft_ms_per_prompt_token))
    return ClassSlo(bounds, base.default)
