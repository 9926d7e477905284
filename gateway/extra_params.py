"""vLLM's extra sampling parameters, parsed into `gateway.protocol.Sampling` fields.

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

The first five map to an engine capability that routing honours (see `ApiRequest.required_capabilities`);
priority needs none (every engine kind can order by it).
"""

from __future__ import annotations

import math

from gateway.errors import InvalidRequest

MAX_BEAM_WIDTH = 64
MAX_CHOICES = 256
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # GenerateRequest.priority is an int32
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/")


def choice_regex(choices: list[str]) -> str:
    """A regex that matches exactly one of `choices` (metacharacters escaped one by one)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) for s in choices) + ")"


def extra_sampling(body: dict, n: int) -> dict:
    """The Sampling fields these parameters set: beam_width, length_penalty, regex, speculative, priority."""
    out: dict = {}
    beam = body.get("use_beam_search")
    if beam is not None and not isinstance(beam, bool):
        raise InvalidRequest(f"'use_beam_search' must be a boolean, got {beam!r}", "use_beam_search")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int)
                                or not 1 <= best_of <= MAX_BEAM_WIDTH):
        raise InvalidRequest(f"'best_of' must be an integer between 1 and {MAX_BEAM_WIDTH}, got {best_of!r}",
                             "best_of")
    if beam:
        width = best_of if best_of is not None else n
        if width < n:
            raise InvalidRequest(f"'best_of' ({width}) must be at least 'n' ({n}) with beam search", "best_of")
        if width < 2:  # as vLLM: a beam of one is greedy decoding, not beam search
            raise InvalidRequest("beam search needs a beam width ('best_of', or 'n') of at least 2", "best_of")
        out["beam_width"] = width
    elif best_of is not None and best_of != n:
        raise InvalidRequest("'best_of' other than 'n' is only supported with 'use_beam_search': true", "best_of")
    penalty = body.get("length_penalty")
    if penalty is not None:
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise InvalidRequest(f"'length_penalty' must be a finite number, got {penalty!r}", "length_penalty")
        out["length_penalty"] = float(penalty)
    out.update(_constraint(body))
    speculative = body.get("speculative")
    if speculative is not None:
        if not isinstance(speculative, bool):
            raise InvalidRequest(f"'speculative' must be a boolean, got {speculative!r}", "speculative")
        out["speculative"] = speculative
    priority = body.get("priority")
    if priority is not None:
        lo, hi = PRIORITY_RANGE
        if isinstance(priority, float) and priority.is_integer():
            priority = int(priority)  # 2.0 is an integer in JSON Schema (gateway/openapi.py says integer)
        if isinstance(priority, bool) or not isinstance(priority, int) or not lo <= priority <= hi:
            raise InvalidRequest(f"'priority' must be an integer between {lo} and {hi} (lower is scheduled "
                                 f"first), got {priority!r}", "priority")
        out["priority"] = priority
    return out


def _constraint(body: dict) -> dict:
    given = [k for k in ("regex", "guided_regex", "guided_choice") if body.get(k) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return {}
    name, value = given[0], body[given[0]]
    if name == "guided_choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"'guided_choice' must be a list of 1 to {MAX_CHOICES} non-empty strings", name)
        return {"regex": choice_regex(value)}
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{name}' must be a non-empty string (a regular expression)", name)
    return {"regex": value}
