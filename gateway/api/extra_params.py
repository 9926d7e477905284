"""vLLM's extra sampling parameters, parsed into `gateway.serving.api_request.Sampling` fields.

OpenAI clients send them in the body (the official SDK's `extra_body`), as vLLM accepts them:

    use_beam_search: bool        beam search; the beam width is best_of (default: n)
    best_of: int                 beam width with use_beam_search; without it only best_of == n is accepted
    length_penalty: float        beam score = cumulative logprob / length ** length_penalty
    regex / guided_regex: str    the output matches this regular expression (structured output)
    guided_choice: [str, ...]    the output is exactly one of these strings (a regex of the escaped choices)
    speculative: bool            per request: true asks for speculative decoding, false turns it off
    priority: int                admission order in the engine, lower first (default 0), as in vLLM; honoured by
                                 workers started with a priority schedule policy (`duet engine paged
                                 --schedule-policy priority`, `duet engine prefix --schedule-policy fcfs`),
                                 ignored by the others

Their types and ranges are in gateway/api/request_models.py. The first five map to an engine capability that routing honours (see `ApiRequest.required_capabilities`);
priority needs none (every engine kind can order by it).
"""

from __future__ import annotations

from gateway.errors import InvalidRequest

_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/")


def choice_regex(choices: list[str]) -> str:
    """A regex that matches exactly one of `choices` (metacharacters escaped one by one)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) for s in choices) + ")"


def extra_sampling(req, n: int) -> dict:
    """The Sampling fields these parameters set: beam_width, length_penalty, regex, speculative, priority.
    `req` is a validated request model (gateway/api/request_models.py checked each field's type and range);
    what is checked here needs several fields at once."""
    out: dict = {}
    best_of = req.best_of
    if req.use_beam_search:
        width = best_of if best_of is not None else n
        if width < n:
            raise InvalidRequest(f"best_of: ({width}) must be at least 'n' ({n}) with beam search", "best_of")
        if width < 2:  # as vLLM: a beam of one is greedy decoding, not beam search
            raise InvalidRequest("best_of: beam search needs a beam width ('best_of', or 'n') of at least 2",
                                 "best_of")
        out["beam_width"] = width
    elif best_of is not None and best_of != n:
        raise InvalidRequest("best_of: other than 'n' is only supported with 'use_beam_search': true", "best_of")
    if req.length_penalty is not None:
        out["length_penalty"] = float(req.length_penalty)
    given = [k for k in ("regex", "guided_regex", "guided_choice") if getattr(req, k) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{given[1]}: give one of {', '.join(given)}, not several", given[1])
    if given == ["guided_choice"]:
        out["regex"] = choice_regex(req.guided_choice)
    elif given:
        out["regex"] = getattr(req, given[0])
    if req.speculative is not None:
        out["speculative"] = req.speculative
    if req.priority is not None:
        out["priority"] = req.priority
    return out
