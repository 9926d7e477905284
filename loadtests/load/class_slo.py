"""Per-class SLOs: a chat turn and a document do not share one TTFT bound.

    ClassBound(ttft_ms, itl_ms, ttft_ms_per_prompt_token=0)   one class's bound
    ClassSlo(bounds=CLASS_SLOS, default=DEFAULT_BOUND)          duck-types report.Slo: `met(record)` uses
                                                                the record's class (summarize takes it)
    parse_class_slos("long_doc=20000,multi_turn=1500")          TTFT overrides, ms (a class's TPOT bound kept)

The defaults (docs/benchmarks.md, "Per-class SLOs"), from the quiet machine's unloaded figures of
`duet bench compare` (a session turn or agent step starts in about 0.4 s, a 1,024-token document in 2.8 s,
TPOT 58 ms, on SmolLM2-135M's shape): an interactive turn (multi_turn, agent, chat) must start within 2 s,
five times its unloaded TTFT - it may wait behind one short prefill, never behind a document's. A document's
bound grows with its length, 4 s plus 4 ms a prompt token (1.5x its unloaded prefill at 2.7 ms a token, plus
queueing): 8.1 s for 1,024 tokens, 20 s for 4,096. Structured output and copy/edit answers are interactive
but longer: 3 s. Every class keeps TPOT <= 250 ms (about 4x unloaded), as `duet bench compare` always had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtests.load.client import RequestRecord


@dataclass(frozen=True)
class ClassBound:
    ttft_ms: float
    itl_ms: float = 250.0
    ttft_ms_per_prompt_token: float = 0.0  # documents: the bound grows with the prompt

    def ttft_bound_ms(self, prompt_tokens: int) -> float:
        return self.ttft_ms + self.ttft_ms_per_prompt_token * prompt_tokens

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft_s * 1000 > self.ttft_bound_ms(r.prompt_tokens):
            return False
        return r.tpot_s is None or r.tpot_s * 1000 <= self.itl_ms

    def describe(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "ttft_ms_per_prompt_token": self.ttft_ms_per_prompt_token,
                "itl_ms": self.itl_ms}


INTERACTIVE = ClassBound(2000.0)
CLASS_SLOS = {
    "multi_turn": INTERACTIVE, "agent": INTERACTIVE, "chat": INTERACTIVE,
    "long_doc": ClassBound(4000.0, ttft_ms_per_prompt_token=4.0),
    "structured": ClassBound(3000.0), "copy_edit": ClassBound(3000.0),
}
DEFAULT_BOUND = ClassBound(5000.0)  # a class with no bound of its own (trace replays): compare's old SLO


@dataclass(frozen=True)
class ClassSlo:
    bounds: dict[str, ClassBound] = field(default_factory=lambda: dict(CLASS_SLOS))
    default: ClassBound = DEFAULT_BOUND
    ttft_ms = None  # report.summarize prints one bound; there is none (describe() has them all)
    itl_ms = None

    def bound(self, traffic_class: str) -> ClassBound:
        return self.bounds.get(traffic_class, self.default)

    def met(self, r: RequestRecord) -> bool:
        return self.bound(r.traffic_class).met(r)

    def describe(self, classes) -> dict:
        return {c: self.bound(c).describe() for c in classes}


def parse_class_slos(text: str, base: ClassSlo | None = None) -> ClassSlo:
    """'long_doc=20000,multi_turn=1500' -> those classes' base TTFT bounds replaced (ms)."""
    base = base or ClassSlo()
    bounds = dict(base.bounds)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            ttft = float(value)
        except ValueError:
            raise ValueError(f"--class-slo: {part!r} is not CLASS=TTFT_MS") from None
        if not ttft > 0:
            raise ValueError(f"--class-slo: the bound of {name} must be positive")
        old = bounds.get(name, base.default)
        bounds[name] = ClassBound(ttft, old.itl_ms, old.ttft_ms_per_prompt_token)
    return ClassSlo(bounds, base.default)
