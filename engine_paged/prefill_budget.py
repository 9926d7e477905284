"""How many prompt tokens a step that decodes may add: a fixed cap, or a time budget from the worker's own steps.

A decoding step's prefill stretches every decoding sequence's inter-token time by what those prompt tokens cost.
A fixed token cap (`max_prefill_tokens_while_decoding`, vLLM's chunked-prefill style) bounds it in tokens, so how
much it stretches a decode step depends on the device: on one CPU core 256 prompt tokens cost 5-20x a decode
step, on an H200 a fraction of one. `--max-decode-step-stretch S` bounds it in time instead: the prompt tokens a
decoding step may add are those whose predicted cost stays within (S - 1) x the time of a step that only decodes,

    tokens = (S - 1) x decode_step_s / prefill_s_per_token,     clamped to [floor, cap]

both measured over the worker's recent steps (`observe`, fed with each step's duration by the serving loop):

    decode_step_s          mean duration of the last `window` decode-only steps
    prefill_s_per_token    over the last `window` steps that prefilled: (their time minus a decode step's, the part
                           the step would have cost anyway) over their prompt tokens; a marginal cost, not a rate

A prompt token's cost grows with its position: its attention reads every key before it, which deep in a document
costs more than the token's matmuls on one CPU core. So the scheduler also says each prefilling step's
attention work, `prefill_keys` = the sum over its prompt tokens of the keys each attends to, and the marginal cost
is fitted as `a x tokens + b x keys` (least squares over the window); the tokens a decoding step may add are then
those whose predicted cost at the position where the next chunk starts fits the slack. Where the window cannot
tell the two terms apart (every chunk alike, or no keys said), b is 0 and a is the plain ratio above.

`floor` (8) keeps prefill moving when a prompt token costs more than the slack (without it a step could add nothing
and a document would wait for every decode to finish); it is small because on one CPU core 32 prompt tokens deep
in a document cost several decode steps, the stretch the budget is there to prevent (at stretch 1.5 on a lightly
loaded Zen 4 core, a floor of 32 gave TPOT p99 4.5x its p50, 8 gave 1.9x: docs/benchmarks.md). `cap` is the fixed
cap, the ceiling. Until both costs are measured the cap alone applies. The scheduler reads no clock: it is told durations, by the
serving loop on a real worker and by the fleet simulator's cost model there, so the same schedule follows from the
same durations.
"""

from __future__ import annotations

import math
from collections import deque


class PrefillBudget:
    def __init__(self, cap: int, stretch: float = 0.0, floor: int = 8, window: int = 32) -> None:
        """`cap`: the most prompt tokens a decoding step adds (0: no cap, the step budget alone). `stretch`: the
        time bound, a multiple of a decode-only step (0: off, the cap alone; else > 1)."""
        if cap < 0:
            raise ValueError(f"the prefill cap must be 0 (none) or more, got {cap}")
        if stretch and not stretch > 1:
            raise ValueError(f"the decode step stretch must be 0 (off) or above 1, got {stretch}")
        if floor < 1:
            raise ValueError(f"the prefill floor must be 1 or more, got {floor}")
        self.cap, self.stretch, self.floor = cap, stretch, floor
        self._decode: deque[float] = deque(maxlen=window)  # seconds of decode-only steps
        self._prefill: deque[tuple[float, int, float]] = deque(maxlen=window)  # (seconds, prompt tokens, keys)

    def observe(self, seconds: float, prefill_tokens: int, decode_tokens: int, prefill_keys: float = 0.0) -> None:
        """One step that ran the model: how long it took and what it computed (kept only with a stretch set: with
        none, nothing reads them). `prefill_keys`: the keys its prompt tokens attended to, summed."""
        if seconds <= 0 or not self.stretch:
            return
        if prefill_tokens:
            self._prefill.append((seconds, prefill_tokens, prefill_keys))
        elif decode_tokens:
            self._decode.append(seconds)

    @property
    def decode_step_s(self) -> float | None:
        return sum(self._decode) / len(self._decode) if self._decode else None

    def costs(self) -> tuple[float, float] | None:
        """(seconds a prompt token, seconds a key it attends to) beyond a decode step, or None until measured."""
        base = self.decode_step_s
        if base is None or not self._prefill:
            return None
        rows = [(max(0.0, s - base), n, k) for s, n, k in self._prefill]
        snn = sum(n * n for _, n, _ in rows)
        skk = sum(k * k for _, _, k in rows)
        snk = sum(n * k for _, n, k in rows)
        sne = sum(n * e for e, n, _ in rows)
        ske = sum(k * e for e, _, k in rows)
        det = snn * skk - snk * snk
        if det > 1e-6 * snn * skk:  # the two terms are told apart: least squares, both costs non-negative
            a, b = (sne * skk - ske * snk) / det, (ske * snn - sne * snk) / det
            if a >= 0 and b >= 0:
                return (a, b) if a + b > 0 else None
            if a < 0 and ske > 0:
                return 0.0, ske / skk
        per_token = sum(e for e, _, _ in rows) / sum(n for _, n, _ in rows)
        return (per_token, 0.0) if per_token > 0 else None

    @property
    def prefill_s_per_token(self) -> float | None:
        costs = self.costs()
        return costs[0] if costs else None

    def tokens_while_decoding(self, position: int = 0) -> int:
        """Prompt tokens a step that decodes may add now, the first of them at `position` in its sequence (0: no
        bound but the step's budget)."""
        if not self.stretch:
            return self.cap
        base, costs = self.decode_step_s, self.costs()
        if base is None or costs is None:
            return self.cap
        a, b = costs
        slack = (self.stretch - 1) * base
        # n tokens from `position` attend to about n x (position + n / 2) keys: a n + b n (position + n / 2) = slack
        linear = a + b * position
        n = slack / linear if b == 0 else (math.sqrt(linear * linear + 2 * b * slack) - linear) / b
        tokens = max(self.floor, int(n + 1e-9))  # 49.999...: 50
        return min(tokens, self.cap) if self.cap else tokens
