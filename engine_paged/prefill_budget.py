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

`floor` keeps prefill moving when a prompt token costs more than the slack (without it a step could add nothing and
a document would wait for every decode to finish); `cap` is the fixed cap, the ceiling. Until both costs are
measured the cap alone applies. The scheduler reads no clock: it is told durations, by the serving loop on a real
worker and by the fleet simulator's cost model there, so the same schedule follows from the same durations.
"""

from __future__ import annotations

from collections import deque


class PrefillBudget:
    def __init__(self, cap: int, stretch: float = 0.0, floor: int = 32, window: int = 32) -> None:
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
        self._prefill: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, prompt tokens)

    def observe(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """One step that ran the model: how long it took and what it computed (kept only with a stretch set: with
        none, nothing reads them)."""
        if seconds <= 0 or not self.stretch:
            return
        if prefill_tokens:
            self._prefill.append((seconds, prefill_tokens))
        elif decode_tokens:
            self._decode.append(seconds)

    @property
    def decode_step_s(self) -> float | None:
        return sum(self._decode) / len(self._decode) if self._decode else None

    @property
    def prefill_s_per_token(self) -> float | None:
        base = self.decode_step_s
        if base is None or not self._prefill:
            return None
        extra = sum(max(0.0, s - base) for s, _ in self._prefill)
        per_token = extra / sum(n for _, n in self._prefill)
        return per_token if per_token > 0 else None

    def tokens_while_decoding(self) -> int:
        """Prompt tokens a step that decodes may add now (0: no bound but the step's budget)."""
        if not self.stretch:
            return self.cap
        base, per_token = self.decode_step_s, self.prefill_s_per_token
        if base is None or per_token is None:
            return self.cap
        tokens = max(self.floor, int((self.stretch - 1) * base / per_token + 1e-9))  # 49.999...: 50
        return min(tokens, self.cap) if self.cap else tokens
