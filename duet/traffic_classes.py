"""The traffic classes and their SLOs: the one table the gateway's `class` label, the Prometheus alert rules, the
benchmark reports (`duet bench classes` / `compare`), the fleet simulator's goodput and `duet bench advise` read.

    TABLE                          the four classes, in the order the gateway tries them (the first that matches wins)
    classify(structured, conversation, prompt_tokens)   the gateway's rule: a request's class
    ClassBound                     one class's SLO, milliseconds: TTFT (+ per prompt token), TPOT
    bound_of(name, profile)        the bound of a table class, or of a benchmark / fleet class through ALIASES
    ALIASES, BENCH_CLASSES, FLEET_CLASSES   the other class names and the table class each one is

Every bound exists at two profiles, since a 135M model on one CPU core and an 8B model on an H200 do not share
a latency:

- `gpu`, production: what the alert rules page on (deploy/prometheus/duet-rules.yml is generated from it:
  duet/slo_alerts.py), and what the fleet simulator's GPU cost models (h200, h200-70b) and so `duet bench advise
  --fleet` judge goodput by. 99% of first tokens and 99% of inter-token gaps within the bound; each bound is a
  histogram bucket edge of gateway/metrics.py. A conversation turn (its prefix mostly cached) starts within 1 s,
  a short one-shot prompt within 2.5 s, structured output (grammar compile and masks) 5 s, a document (prefill
  dominates) 10 s; TPOT 100 ms (faster than a person reads), 150 ms where masks or long attention slow decode.
- `cpu`, the bench machine (the bench model on one core: `duet bench classes`, `compare --pin-cores`, the fleet
  simulator's cpu cost model and `--validate`, advise's local and routing-simulation default), from the quiet
  machine's unloaded figures of `duet bench compare` (a session turn or agent step starts in about 0.4 s, a
  1,024-token document in 2.8 s, TPOT 58 ms, on SmolLM2-135M's shape): an interactive turn must start within
  2 s, five times its unloaded TTFT - it may wait behind one short prefill, never behind a document's. A
  document gets 4 s plus 4 ms a prompt token (1.5x its unloaded prefill at 2.7 ms a token, plus queueing): 8.1 s
  for 1,024 tokens, 20 s for 4,096. Structured output and other one-shot prompts (copy/edit answers) are
  interactive but longer: 3 s. TPOT <= 250 ms for all (about 4x unloaded).

No class has an end-to-end bound: goodput and the alerts judge TTFT and TPOT. `UNCLASSIFIED` (5 s, 250 ms) is
the bound of a benchmark class the table does not name (trace replays) and `duet bench compare`'s one SLO for
every class when it runs without per-class SLOs.

Until this table, the fleet simulator had bounds of its own (h200: chat 3 s, document 6 s, TPOT 100 ms; cpu:
chat 5 s, document 10 s, TPOT 250 ms): the figures in docs/history/ from before it were judged by those.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

GPU, CPU = "gpu", "cpu"
PROFILES = (GPU, CPU)
DOCUMENT_PROMPT_TOKENS = 1024  # a one-shot prompt this long is a document: its prefill dominates TTFT


@dataclass(frozen=True)
class ClassBound:
    ttft_ms: float
    itl_ms: float = 250.0  # the bound on TPOT (mean time per output token after the first)
    ttft_ms_per_prompt_token: float = 0.0  # documents on the bench machine: the bound grows with the prompt

    def ttft_bound_ms(self, prompt_tokens: int) -> float:
        return self.ttft_ms + self.ttft_ms_per_prompt_token * prompt_tokens

    def met_by(self, ttft_s: float, tpot_s: float | None, prompt_tokens: int) -> bool:
        """A served request's figures (seconds, as measured) within this bound; no TPOT (one output token)
        leaves only the TTFT to meet."""
        if ttft_s * 1000 > self.ttft_bound_ms(prompt_tokens):
            return False
        return tpot_s is None or tpot_s * 1000 <= self.itl_ms

    def met(self, r) -> bool:
        """`r` a loadtests.load.client.RequestRecord (duck-typed: ok, ttft_s, tpot_s, prompt_tokens)."""
        return r.ok and self.met_by(r.ttft_s, r.tpot_s, r.prompt_tokens)

    def describe(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "ttft_ms_per_prompt_token": self.ttft_ms_per_prompt_token,
                "itl_ms": self.itl_ms}


@dataclass(frozen=True)
class TrafficClass:
    name: str  # the value of the gateway's `class` label
    recognised_by: str  # the gateway's rule for it, in words (classify() is the rule)
    gpu: ClassBound
    cpu: ClassBound

    def bound(self, profile: str) -> ClassBound:
        if profile not in PROFILES:
            raise ValueError(f"unknown SLO profile {profile!r} (profiles: {', '.join(PROFILES)})")
        return getattr(self, profile)


TABLE = (
    TrafficClass("structured", "json_schema, json_object, regex, choice or tools (grammar compile and token "
                 "masks), whatever the prompt", gpu=ClassBound(5000.0, 150.0), cpu=ClassBound(3000.0)),
    TrafficClass("session", "a conversation: an `x-session-id`, a Responses conversation or `previous_response_id`, "
                 "or a chat with more than one user turn (its prefix is mostly cached)",
                 gpu=ClassBound(1000.0, 100.0), cpu=ClassBound(2000.0)),
    TrafficClass("document", f"a one-shot prompt of {DOCUMENT_PROMPT_TOKENS} tokens or more (prefill dominates)",
                 gpu=ClassBound(10000.0, 150.0), cpu=ClassBound(4000.0, ttft_ms_per_prompt_token=4.0)),
    TrafficClass("oneshot", "everything else", gpu=ClassBound(2500.0, 100.0), cpu=ClassBound(3000.0)),
)
CLASSES = tuple(c.name for c in TABLE)
UNCLASSIFIED = ClassBound(5000.0)

# The benchmarks' and the fleet simulator's class names, each with the table class the gateway labels its
# requests with: the one mapping.
BENCH_CLASSES = {  # duet bench classes / compare: loadtests/load/class_workloads.py, workloads.py
    "multi_turn": "session",  # every turn sends x-session-id
    "agent": "session",  # every step sends x-session-id
    "chat": "session",
    "long_doc": "document",  # one-shot prompts of 1-4k tokens
    "structured": "structured",  # response_format json_schema
    "copy_edit": "oneshot",  # a one-shot prompt of about 450 tokens
}
FLEET_CLASSES = {  # the fleet simulator: loadtests/sim/fleet/workload.py
    "chat": "session",  # Mooncake's conversation turns, each with its session key
    "document": "document",  # the Azure code trace's one-shot prompts (2k tokens mean)
}
ALIASES = {**BENCH_CLASSES, **FLEET_CLASSES}


def table_class(name: str) -> TrafficClass:
    """The table's row for a table class or for a benchmark / fleet class (KeyError for any other name)."""
    target = ALIASES.get(name, name)
    for c in TABLE:
        if c.name == target:
            return c
    raise KeyError(name)


def bound_of(name: str, profile: str) -> ClassBound:
    return table_class(name).bound(profile)


def classify(structured: bool, conversation: bool, prompt_tokens: int,
             document_tokens: int = DOCUMENT_PROMPT_TOKENS) -> str:
    """The class of a request, TABLE's rows tried in order. Structured output wins over the rest: its grammar
    shapes the latency whatever the prompt; then a conversation (whose prefix is usually cached); then a long
    one-shot prompt; else a plain one-shot."""
    if structured:
        return "structured"
    if conversation:
        return "session"
    if prompt_tokens >= document_tokens:
        return "document"
    return "oneshot"


def _seconds(ms: float) -> str:
    return f"{ms / 1000:g} s" if ms >= 1000 else f"{ms:g} ms"


def _ttft(b: ClassBound) -> str:
    return _seconds(b.ttft_ms) + (f" + {b.ttft_ms_per_prompt_token:g} ms/token" if b.ttft_ms_per_prompt_token else "")


def markdown() -> str:
    """The table as docs/operations.md shows it (tests/duet/test_traffic_classes.py checks the page has it)."""
    header = ("| Class | The gateway gives it to | TTFT, TPOT (gpu: production, the alerts) | "
              "TTFT, TPOT (cpu: the bench machine) | Benchmark and fleet classes |")
    rows = [header, "|---|---|---|---|---|"]
    for c in TABLE:
        others = "; ".join(f"{kind}: " + ", ".join(f"`{n}`" for n, t in names.items() if t == c.name)
                           for kind, names in (("bench", BENCH_CLASSES), ("fleet", FLEET_CLASSES))
                           if c.name in names.values())
        rows.append(f"| `{c.name}` | {c.recognised_by} | {_ttft(c.gpu)}, {_seconds(c.gpu.itl_ms)} | "
                    f"{_ttft(c.cpu)}, {_seconds(c.cpu.itl_ms)} | {others} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m duet.traffic_classes: the table, as markdown
    sys.stdout.write(markdown())
