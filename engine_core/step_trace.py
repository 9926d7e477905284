"""A per-step trace of a serving worker, for checking a model of its steps against the real thing (the fleet
simulator's `cpu` cost model: `duet bench fleet --validate`). Off unless `DUET_STEP_TRACE` names a directory.

When on, the worker appends one JSON line per step that ran the model to `<dir>/steps-<pid>.jsonl`:
`t` (wall-clock time the step began, time.time(), so that traces of several processes line up), `step_s`
(the whole `EngineCore.step`: schedule, forward, sample, process), `forward_s` (the model runner's forward
alone) and `chunks` ([new tokens, tokens already in its pages, logits rows] per sequence: what the cost model reads,
loadtests/sim/fleet/cost_models.shape_of).
A diagnosis knob like DUET_DEBUG_STEP_DELAY_MS, never for production: it writes a line per step.

`python -m engine_core.step_trace DIR` sums each worker's trace by the kind of step (`step_kinds`): decode-only
steps, steps that decode and prefill (mixed) and prefill-only ones; where a worker's time went, and so where a
scheduler put the prompts' work (beside decodes, stretching inter-token times, or in steps of their own).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

STEP_TRACE_ENV = "DUET_STEP_TRACE"


class TracingRunner:
    """The runner, with the chunks and duration of its last forward kept for the trace."""

    def __init__(self, runner) -> None:
        self.inner = runner
        self.last_chunks: list[list[int]] = []
        self.last_forward_s = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)  # kv_pool, vocab_size, copy_pages, ...: the real runner's

    def forward(self, chunks):
        self.last_chunks = [[len(c.token_ids), c.start_pos, len(c.logits_positions)] for c in chunks]
        t0 = time.perf_counter()
        try:
            return self.inner.forward(chunks)
        finally:
            self.last_forward_s = time.perf_counter() - t0


class StepTrace:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"steps-{os.getpid()}.jsonl"
        self._file = self.path.open("a", buffering=1)  # a line at a time: a killed worker keeps its trace

    @classmethod
    def from_env(cls, environ=os.environ) -> StepTrace | None:
        raw = environ.get(STEP_TRACE_ENV, "").strip()
        return cls(Path(raw)) if raw else None

    def write(self, began_wall: float, step_s: float, runner: TracingRunner) -> None:
        self._file.write(json.dumps({"t": round(began_wall, 6), "step_s": round(step_s, 6),
                                     "forward_s": round(runner.last_forward_s, 6), "chunks": runner.last_chunks})
                         + "\n")


def step_kinds(records: list[dict]) -> dict[str, dict]:
    """Per kind of step ("decode", "mixed", "prefill"; a chunk of one new token decodes): steps, seconds in all,
    median and p99 step ms (numpy's interpolated percentile), mean prompt tokens and mean decoding sequences a step.
    The p99 of the decode-only steps against their median is how much decode steps alone vary (who is decoding)."""
    groups: dict[str, list[tuple[float, int, int]]] = {}
    for r in records:
        prompt = sum(new for new, _, _ in r["chunks"] if new > 1)
        decodes = sum(1 for new, _, _ in r["chunks"] if new == 1)
        kind = "decode" if not prompt else "mixed" if decodes else "prefill"
        groups.setdefault(kind, []).append((r["step_s"], prompt, decodes))
    out = {}
    for kind in ("decode", "mixed", "prefill"):
        rows = groups.get(kind)
        if rows:
            secs = [s for s, _, _ in rows]
            out[kind] = {"steps": len(rows), "seconds": sum(secs), "median_ms": 1000 * statistics.median(secs),
                         "p99_ms": 1000 * float(np.percentile(secs, 99)),
                         "prompt_tokens": sum(p for _, p, _ in rows) / len(rows),
                         "decoding": sum(d for _, _, d in rows) / len(rows)}
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_core.step_trace", description="each worker's steps by kind")
    p.add_argument("directory", type=Path, help="the DUET_STEP_TRACE directory")
    args = p.parse_args(argv)
    traces = read_traces(args.directory)
    if not traces:
        print(f"no steps-*.jsonl in {args.directory}")
        return 1
    for pid, records in traces.items():
        print(f"worker {pid}: {len(records)} steps, {sum(r['step_s'] for r in records):.1f} s")
        for kind, k in step_kinds(records).items():
            print(f"  {kind:8s} {k['steps']:6d} steps {k['seconds']:7.1f} s  median {k['median_ms']:7.1f} ms  "
                  f"p99 {k['p99_ms']:7.1f} ms  prompt tokens {k['prompt_tokens']:6.0f}  decoding {k['decoding']:5.1f}")
    return 0


def read_traces(directory: Path) -> dict[int, list[dict]]:
    """Every worker's trace in `directory`: its pid -> its step records, in order."""
    return {int(p.stem.removeprefix("steps-")): [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in sorted(Path(directory).glob("steps-*.jsonl"))}


if __name__ == "__main__":
    raise SystemExit(main())
