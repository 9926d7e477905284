"""Request bodies -> Python values, with every hostile shape turned into `InvalidRequest` (a 400).

`json.loads` alone lets four kinds of input escape as a plain 500: nesting deep enough to hit the
interpreter's recursion limit, integers longer than Python's int-string limit (4,300 digits),
`NaN`/`Infinity` literals and floats that overflow to infinity (which later break JSON responses),
and strings holding lone UTF-16 surrogates (`"\\ud800"`, which no tokenizer or UTF-8 encoder accepts).
`parse_json_body` bounds the nesting depth before decoding (a scan over the bracket characters
outside string literals, at C speed for the common body), bounds number literals while decoding,
and checks strings after decoding. The bounds are far above anything the OpenAI API needs.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.errors import InvalidRequest

MAX_DEPTH = 64  # objects/arrays inside each other
MAX_NUMBER_CHARS = 64  # digits (and sign, dot, exponent) of one number literal

_STRING_LITERAL = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def parse_json_body(raw: bytes | str) -> Any:
    """Decode one JSON document; raise InvalidRequest with the reason for anything a handler cannot
    safely use. Only finite numbers, bounded depth and valid Unicode come out."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the request body is not valid UTF-8: {e}") from None
    _check_depth(raw)
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the depth scan should make this unreachable; never a 500 regardless
        raise InvalidRequest(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    _check_strings(value)  # recursion is safe: the depth is bounded above
    return value


def _check_depth(raw: bytes) -> None:
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return  # cannot nest deeper than the number of openers
    brackets = _STRING_LITERAL.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for b in brackets:
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > MAX_DEPTH:
                raise InvalidRequest(f"the request body nests deeper than {MAX_DEPTH} levels")
        else:
            depth -= 1


def _parse_int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_CHARS:
        raise InvalidRequest(f"a number in the request body has {len(literal)} digits (at most "
                             f"{MAX_NUMBER_CHARS} are accepted)")
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise InvalidRequest(f"a number in the request body is {len(literal)} characters long (at most "
                             f"{MAX_NUMBER_CHARS} are accepted)")
    value = float(literal)
    if not math.isfinite(value):
        raise InvalidRequest(f"the number {literal[:24]} is out of range (numbers must be finite)")
    return value


def _reject_constant(name: str) -> float:
    raise InvalidRequest(f"{name} is not valid JSON (numbers must be finite)")


def _check_strings(value: Any) -> None:
    """Every string (keys too) must encode as UTF-8: a lone surrogate from a `\\ud800` escape does not."""
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k)
            if not isinstance(v, (int, float, bool)) and v is not None:
                _check_strings(v)
    elif isinstance(value, list):
        for v in value:
            if not isinstance(v, (int, float, bool)) and v is not None:
                _check_strings(v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"the request body holds a string that is not valid Unicode ({e.reason} at "
                             f"position {e.start}: a lone UTF-16 surrogate escape such as \\ud800)") from None
