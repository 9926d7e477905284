"""A request body -> its pydantic model (gateway/api/request_models.py and the per-API models), with a
`ValidationError` turned into one `InvalidRequest` a user can read: the field's path and what is
wrong with it, e.g. `temperature: must be <= 2.0, got 5` or `messages[0].role: must be 'user' or
'assistant', got "robot"`, with `param` the top-level field (at most three fields are named). gateway/errors.py then gives
it each API's own shape (OpenAI's error object, or Anthropic's on /v1/messages*): this module is the
one place where the models' rules become messages.

The body has been through gateway/body_parser.py first (bounded depth and numbers, valid Unicode).

A union that fails reports the branches that got furthest (a list of parts that went deep, not the
string the field might also have been), and of those the ones with fewest errors; what is left is
said with "or" (`tool_choice: must be one of 'none', 'auto' or 'required' or an object`). A rule a
pydantic error type cannot say well comes with its own message (PydanticCustomError), or with a
phrase for its pattern (PATTERN_PHRASES).
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
MAX_REPORTED = 3  # distinct bad fields named in one message

# the phrase for a `Field(pattern=...)` that a person should not have to read as a regex
PATTERN_PHRASES: dict[str, str] = {}

_TYPES = {"int_type": "an integer", "int_from_float": "an integer", "int_parsing": "an integer",
          "float_type": "a number", "bool_type": "a boolean", "string_type": "a string", "list_type": "a list",
          "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
          "none_required": "null"}


def validate(model: type[M], body: object) -> M:
    """`model` validated from `body`, or InvalidRequest naming the bad fields (see the module doc)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_request(e) from None


def refuse_unsupported(body: dict, fields: dict[str, str]) -> None:
    """A field Duet does not do (`fields`: name -> why), given a value, is a 400 naming it: never
    accepted and ignored. These fields are not in the models, so /openapi.json does not offer them."""
    for name, why in fields.items():
        if body.get(name) not in (None, "", [], {}):
            raise InvalidRequest(f"'{name}' is not supported: {why}", name)


def invalid_request(e: ValidationError) -> InvalidRequest:
    found = [(_path(err["loc"]), err) for err in _best_branches(e.errors(include_url=False))]
    paths = [p for p, _ in found]
    # a union branch that stopped short of another branch's error is noise
    kept = [(p, err) for p, err in found if not any(len(q) > len(p) and q[: len(p)] == p for q in paths)]
    by_path: dict[tuple, list[dict]] = {}
    for p, err in kept:
        by_path.setdefault(p, []).append(err)
    parts = []
    for p, errs in list(by_path.items())[:MAX_REPORTED]:
        what = _either(list(dict.fromkeys(_phrase(err) for err in errs))) + _got(errs[0])
        parts.append(f"{_render(p)}: {what}" if p else what)
    first = next(iter(by_path))
    return InvalidRequest("; ".join(parts), str(first[0]) if first else None)


def _best_branches(errs: list[dict], start: int = 0) -> list[dict]:
    """Of a union's failed branches, those that got furthest (the deepest error), and of those the
    ones with fewest errors: `[1, "a"]` as a prompt is a list of token ids with one bad item, not a
    list of strings with one. Unions inside the chosen branches are pruned the same way."""
    out, unions = [], {}
    for err in errs:
        loc = err["loc"]
        at = next((i for i in range(start, len(loc)) if _is_label(loc[i])), None)
        if at is None:
            out.append(err)
        else:
            unions.setdefault(loc[:at], {}).setdefault(loc[at], []).append(err)
    for prefix, branches in unions.items():
        score = {label: (max(len(_path(e["loc"])) for e in es), -len(es)) for label, es in branches.items()}
        best = max(score.values())
        out += _best_branches([e for label, es in branches.items() if score[label] == best for e in es],
                              len(prefix) + 1)
    return out


def _is_label(part: object) -> bool:
    """A union-branch label pydantic puts in a location: 'str', 'list[...]', 'ChatMessage',
    'constrained-str', 'function-after[...]' (no field of the API is spelt like these)."""
    return isinstance(part, str) and ("[" in part and part != "[key]" or "-" in part or part[:1].isupper()
                                      or part in ("str", "int", "float", "bool", "none", "dict", "list"))


def _path(loc: tuple) -> tuple:
    """The fields and indexes of `loc`, without pydantic's union-branch labels ('str', 'list[...]',
    'ChatMessage', 'function-after[...]'); a dict key stays (logit_bias.5)."""
    out = []
    for part in loc:
        if isinstance(part, int) or part != "[key]" and not _is_label(part):
            out.append(part)
    return tuple(out)


def _render(path: tuple) -> str:
    s = ""
    for part in path:
        s += f"[{part}]" if isinstance(part, int) else (f".{part}" if s else part)
    return s


def _value(v: object) -> str:
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _got(err: dict) -> str:
    got = err.get("input")
    scalar = got is None or isinstance(got, (str, int, float, bool))
    return f", got {_value(got)}" if scalar and err["type"] not in ("missing", "union_tag_invalid") else ""


def _phrase(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return "is required"
    if kind in _TYPES:
        return f"must be {_TYPES[kind]}"
    if kind in ("less_than_equal", "greater_than_equal", "less_than", "greater_than"):
        op = {"less_than_equal": ("<=", "le"), "greater_than_equal": (">=", "ge"), "less_than": ("<", "lt"),
              "greater_than": (">", "gt")}[kind]
        return f"must be {op[0]} {ctx[op[1]]}"
    if kind == "string_too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else f"must be at least {ctx['min_length']} " \
                                                                       f"characters"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind == "too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else f"must have at least {ctx['min_length']} items"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items"
    if kind == "literal_error":
        expected = ctx.get("expected", "").replace("True", "true").replace("False", "false")  # JSON's words
        return f"must be one of {expected}" if "," in expected else f"must be {expected}"
    if kind == "union_tag_invalid":
        return f"{ctx.get('discriminator', 'type').strip(chr(39))} {_value(ctx.get('tag'))} is not supported " \
               f"(expected one of {ctx.get('expected_tags')})"
    if kind == "union_tag_not_found":
        return f"needs a {ctx.get('discriminator', 'type')}"
    if kind == "string_pattern_mismatch":
        return PATTERN_PHRASES.get(ctx.get("pattern"), f"must match {ctx.get('pattern')}")
    return err["msg"][:1].lower() + err["msg"][1:]  # a custom error (PydanticCustomError) says it itself


def _either(phrases: list[str]) -> str:
    """'must be a string' + 'must be a list' -> 'must be a string or a list'."""
    out = phrases[0]
    for p in phrases[1:]:
        out += " or " + (p[len("must be "):] if p.startswith("must be ") and out.startswith("must be ") else p)
    return out
