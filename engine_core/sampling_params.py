"""Per-request sampling settings, with the validation every engine runs before any work starts.

Each setting's default and range is duet/contract.py's. Semantics follow vLLM / the OpenAI API:
- temperature 0 means greedy (argmax after penalties);
- top_k None means no top-k cut; top_p 1.0 and min_p 0.0 mean no cut;
- presence/frequency penalties count generated tokens only; repetition_penalty (HF/CTRL style) covers the
  prompt and the generated tokens;
- logprobs=k returns the sampled token's logprob plus the top k alternatives (k may be 0), computed from the
  raw model logits (before penalties and temperature);
- min_tokens keeps EOS and stop_token_ids from being sampled until that many tokens exist;
- ignore_eos keeps generating past EOS (stop_token_ids still stop);
- logit_bias adds its value to those token ids' logits after the min_tokens mask and before
  the penalties (vLLM's order); logprobs stay those of the unbiased model;
- prompt_logprobs=k returns each prompt token's logprob (from the second token on) plus the top k
  alternatives, from the raw model logits;
- speculative None follows the worker's setting, True asks for speculative decoding (an engine without it
  refuses the request), False turns drafting off for this request.
"""

from __future__ import annotations

from dataclasses import dataclass

from duet import contract as c
from engine_core.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """Defaults and ranges are duet/contract.py's (the gateway's request models enforce the same ranges)."""

    max_tokens: int = c.MAX_TOKENS.default  # 16; the gateway's default is "fill the context" (duet/contract.py)
    temperature: float = c.TEMPERATURE.default
    top_p: float = c.TOP_P.default
    top_k: int | None = c.TOP_K.default
    min_p: float = c.MIN_P.default
    presence_penalty: float = c.PRESENCE_PENALTY.default
    frequency_penalty: float = c.FREQUENCY_PENALTY.default
    repetition_penalty: float = c.REPETITION_PENALTY.default
    seed: int | None = c.SEED.default
    logprobs: int | None = c.LOGPROBS.default
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = c.MIN_TOKENS.default
    ignore_eos: bool = False
    n: int = c.N.default
    beam_width: int = c.BEAM_WIDTH.default
    length_penalty: float = c.LENGTH_PENALTY.default
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    speculative: bool | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    prompt_logprobs: int | None = c.PROMPT_LOGPROBS.default

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field; return None when all are valid."""
        _check(c.MAX_TOKENS.admits(self.max_tokens),
               f"max_tokens must be an integer in {c.MAX_TOKENS.interval}, got {self.max_tokens!r}")
        _check(c.TEMPERATURE.admits(self.temperature),
               f"temperature must be in {c.TEMPERATURE.interval} (0 means greedy), got {self.temperature!r}")
        _check(c.TOP_P.admits(self.top_p), f"top_p must be in {c.TOP_P.interval}, got {self.top_p!r}")
        _check(self.top_k is None or c.TOP_K.admits(self.top_k),
               f"top_k must be an integer in {c.TOP_K.interval} (or unset for no limit), got {self.top_k!r}")
        _check(c.MIN_P.admits(self.min_p), f"min_p must be in {c.MIN_P.interval}, got {self.min_p!r}")
        for bound in (c.PRESENCE_PENALTY, c.FREQUENCY_PENALTY):
            value = getattr(self, bound.name)
            _check(bound.admits(value), f"{bound.name} must be in {bound.interval}, got {value!r}")
        _check(c.REPETITION_PENALTY.admits(self.repetition_penalty),
               f"repetition_penalty must be in {c.REPETITION_PENALTY.interval} (1 means none), "
               f"got {self.repetition_penalty!r}")
        _check(self.seed is None or c.SEED.admits(self.seed),
               f"seed must be an integer in {c.SEED.interval}, got {self.seed!r}")
        for bound in (c.LOGPROBS, c.PROMPT_LOGPROBS):
            value = getattr(self, bound.name)
            _check(value is None or bound.admits(value),
                   f"{bound.name} must be an integer in {bound.interval}, got {value!r}")
        for token_id, bias in self.logit_bias:
            _check(isinstance(token_id, int) and 0 <= token_id < vocab_size,
                   f"logit_bias token id {token_id!r} is not in this model's vocabulary (0..{vocab_size - 1})")
            _check(c.LOGIT_BIAS.admits(bias),
                   f"logit_bias values must be in {c.LOGIT_BIAS.interval}, got {bias!r} for token {token_id}")
        for token_id in self.stop_token_ids:
            _check(isinstance(token_id, int) and 0 <= token_id < vocab_size,
                   f"stop token id {token_id!r} is not in this model's vocabulary (0..{vocab_size - 1})")
        _check(c.MIN_TOKENS.admits(self.min_tokens) and self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(c.N.admits(self.n), f"n must be an integer in {c.N.interval}, got {self.n!r}")
        _check(c.BEAM_WIDTH.admits(self.beam_width),
               f"beam_width must be an integer in {c.BEAM_WIDTH.interval}, got {self.beam_width!r}")
        _check(c.LENGTH_PENALTY.admits(self.length_penalty),
               f"length_penalty must be a finite number, got {self.length_penalty!r}")
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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
