"""Per-request sampling settings, with the validation every engine runs before any work starts.

Semantics follow vLLM / the OpenAI API:
- temperature 0 means greedy (argmax after penalties);
- top_k None means no top-k cut; top_p 1.0 and min_p 0.0 mean no cut;
- presence/frequency penalties count generated tokens only; repetition_penalty (HF/CTRL style) covers the
  prompt and the generated tokens;
- logprobs=k returns the sampled token's logprob plus the top k alternatives (k may be 0), computed from the
  raw model logits (before penalties and temperature), at most 20;
- min_tokens keeps EOS and stop_token_ids from being sampled until that many tokens exist;
- ignore_eos keeps generating past EOS (stop_token_ids still stop);
- logit_bias adds its value (in [-100, 100]) to those token ids' logits after the min_tokens mask and before
  the penalties (vLLM's order); logprobs stay those of the unbiased model;
- prompt_logprobs=k returns each prompt token's logprob (from the second token on) plus the top k
  alternatives, from the raw model logits;
- speculative None follows the worker's setting, True asks for speculative decoding (an engine without it
  refuses the request), False turns drafting off for this request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_core.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    speculative: bool | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field; return None when all are valid."""
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(_finite(self.temperature) and self.temperature >= 0.0,
               f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
               f"top_k must be an integer >= 1 (or unset for no limit), got {self.top_k!r}")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value!r}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0 (1 means none), got {self.repetition_penalty!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**64),
               f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for token_id, bias in self.logit_bias:
            _check(isinstance(token_id, int) and 0 <= token_id < vocab_size,
                   f"logit_bias token id {token_id!r} is not in this model's vocabulary (0..{vocab_size - 1})")
            _check(_finite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")
        for token_id in self.stop_token_ids:
            _check(isinstance(token_id, int) and 0 <= token_id < vocab_size,
                   f"stop token id {token_id!r} is not in this model's vocabulary (0..{vocab_size - 1})")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(isinstance(self.beam_width, int) and self.beam_width >= 1,
               f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        _check(_finite(self.length_penalty), f"length_penalty must be a finite number, got {self.length_penalty!r}")
        constraints = [self.json_schema is not None, self.json_object, self.regex is not None]
        _check(sum(constraints) <= 1, "at most one of json_schema, json_object and regex may be set")

    def finish_reason(self, output_token_ids: list[int], eos_token_ids: tuple[int, ...], *,
                      max_model_len: int | None = None, num_prompt_tokens: int = 0) -> str | None:
        """The one stopping rule of every engine: "stop" when the last token is a stop id (or EOS, unless
        ignore_eos), "length" at max_tokens or when prompt + output fill `max_model_len`, else None.

        min_tokens needs no check here: the sampler never emits a stop/EOS id before min_tokens.
        """
        if not output_token_ids:
            return None
        last = output_token_ids[-1]
        if last in self.stop_token_ids or (not self.ignore_eos and last in eos_token_ids):
            return "stop"
        if len(output_token_ids) >= self.max_tokens:
            return "length"
        if max_model_len is not None and num_prompt_tokens + len(output_token_ids) >= max_model_len:
            return "length"
        return None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
