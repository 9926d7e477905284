"""How fast this engine prefills and decodes, measured over its recent steps (GetLoad reports it).

The gateway's admission control divides the prefill queued on a worker by the worker's prefill rate
to estimate how long a new request would wait (gateway/serving/admission.py), so the rate must be what the
worker does under its real mix of work:

    prefill_tokens_per_s   prompt tokens of the last `window` steps that prefilled, over those steps'
                           whole duration (the decode tokens sharing a step slow its prefill, and count)
    decode_tokens_per_s    tokens of the last `window` decode-only steps, over their duration

A ratio of sums, not a mean of ratios: a full 2,048-token chunk weighs more than a 20-token tail.
Zero until the first such step: the gateway then has no estimate and admits.
"""

from __future__ import annotations

from collections import deque


class StepRates:
    def __init__(self, window: int = 32) -> None:
        self._prefill: deque[tuple[int, float]] = deque(maxlen=window)  # (prompt tokens, seconds)
        self._decode: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        if seconds <= 0:
            return
        if prefill_tokens:
            self._prefill.append((prefill_tokens, seconds))
        elif decode_tokens:
            self._decode.append((decode_tokens, seconds))

    @staticmethod
    def _rate(samples: deque[tuple[int, float]]) -> float:
        seconds = sum(s for _, s in samples)
        return sum(n for n, _ in samples) / seconds if seconds > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._rate(self._prefill)

    @property
    def decode_tokens_per_s(self) -> float:
        return self._rate(self._decode)
