"""Structured output on the tiny checkpoint's real tokenizer: masks touch only constrained rows, grammars are
compiled once and dropped least-recently-used, bad constraints are InvalidRequestError with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from engine_core.errors import InvalidRequestError
from engine_prefix.structured import GrammarCache, apply_masks, tokenizer_info


@pytest.fixture(scope="module")
def grammars(tiny_checkpoint):
    return GrammarCache(tokenizer_info(tiny_checkpoint, 1000, (0, 2)), capacity=2)


def test_masks_change_only_constrained_rows_and_force_the_grammar(grammars, tiny_checkpoint):
    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    c = grammars.constraint(("regex", r"yes|no"))
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(10):
        logits = torch.randn(3, 1000, generator=gen)
        before = logits.clone()
        apply_masks(logits, [(1, c)])
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        token = int(logits[1].argmax())
        assert c.accept(token)
        if token in (0, 2):  # once the grammar is complete only EOS is allowed; accepting it ends it
            break
        out.append(token)
    assert tok.decode(out) in ("yes", "no") and c.terminated


def test_grammars_compile_once_and_drop_least_recently_used(grammars):
    start = grammars.num_compiled
    a, b, d = ("regex", "a+"), ("regex", "b+"), ("json_schema", json.dumps({"type": "integer"}))
    grammars.get(a)
    grammars.get(b)
    grammars.get(a)  # cached; a is now the most recent
    assert grammars.num_compiled == start + 2
    grammars.get(d)  # capacity 2: b goes
    grammars.get(a)
    assert grammars.num_compiled == start + 3
    grammars.get(b)
    assert grammars.num_compiled == start + 4


@pytest.mark.parametrize("key,reason", [(("json_schema", "[1, 2"), "not valid JSON"),
                                        (("json_schema", '{"type": "nope"}'), "nope"),
                                        (("regex", "(ab"), "regex")])
def test_bad_constraints_raise_invalid_request_with_the_reason(grammars, key, reason):
    with pytest.raises(InvalidRequestError, match=reason):
        grammars.get(key)
