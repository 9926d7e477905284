"""Structured output through xgrammar: JSON object, JSON schema and regex constraints.

- ``GrammarCache`` compiles each distinct constraint once (LRU of compiled grammars); a schema or regex
  that does not compile is ``InvalidRequestError`` carrying xgrammar's reason. The engine compiles at
  admission (``Scheduler.validate``), so a bad constraint never reaches the scheduler.
- ``Constraint`` follows one request: before sampling, its row of the logits gets every token the grammar
  forbids set to -inf (``apply_masks``), so the shared sampler draws only allowed tokens and rows of free
  requests in the same batch are untouched; after sampling, ``accept`` advances the grammar. Once the
  grammar is complete only the stop tokens are allowed, so a constrained request ends with EOS.
- Constrained requests are never drafted by speculative decoding (see speculative.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import torch
import xgrammar as xgr

from engine_core.errors import InvalidRequestError


def tokenizer_info(model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, read from the model's tokenizer.json (byte-level BPE or raw)."""
    path = Path(model_path) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"structured output needs {path}: {exc}") from exc
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    decoder = (spec.get("decoder") or {}).get("type")
    pre = json.dumps(spec.get("pre_tokenizer") or {})
    if decoder == "ByteLevel" or "ByteLevel" in pre:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif decoder == "Sequence" and "ByteFallback" in json.dumps(spec.get("decoder")):
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def constraint_key(json_schema: str | None, json_object: bool, regex: str | None) -> tuple[str, str] | None:
    """('json_schema', text) | ('json_object', '') | ('regex', text) | None for a free request."""
    if json_schema is not None:
        return ("json_schema", json_schema)
    if json_object:
        return ("json_object", "")
    if regex is not None:
        return ("regex", regex)
    return None


class GrammarCache:
    """Compiled grammars by constraint, least recently used dropped past ``capacity``. Thread-safe: the
    gRPC event loop compiles at admission while the step thread builds matchers."""

    def __init__(self, info: xgr.TokenizerInfo, capacity: int = 128) -> None:
        self.info = info
        self.capacity = capacity
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations actually run (tests check the cache works)

    def get(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None:
                self._compiled.move_to_end(key)
                return grammar
        grammar = self._compile(*key)
        with self._lock:
            self._compiled[key] = grammar
            self.num_compiled += 1
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                try:
                    json.loads(text)
                except ValueError as exc:
                    raise InvalidRequestError(f"json_schema is not valid JSON: {exc}") from exc
                ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
                # xgrammar 0.2.9 lets length-bounded strings hold raw control characters, which strict JSON
                # parsers reject; close that hole in the generated grammar.
                ebnf = ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)
                return self._compiler.compile_grammar(ebnf)
            if kind == "regex":
                return self._compiler.compile_regex(text)
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the reason
            raise InvalidRequestError(f"invalid {kind}: {exc}") from exc
        raise InvalidRequestError(f"unknown constraint kind {kind!r}")

    def constraint(self, key: tuple[str, str]) -> Constraint:
        return Constraint(xgr.GrammarMatcher(self.get(key)), self.info.vocab_size)


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (cannot happen after masking)."""
        if self.matcher.is_terminated():
            return True
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        """Back to the start (a preempted request replays its output through accept)."""
        self.matcher.reset()


def apply_masks(logits: torch.Tensor, rows: list[tuple[int, Constraint]]) -> None:
    """Set the forbidden tokens of each constrained row of ``logits`` [R, V] to -inf, in place."""
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, (_, c) in enumerate(rows):
        if c.matcher.is_terminated():
            xgr.reset_token_bitmask(bitmask[i : i + 1])  # all allowed; the request stops on its own
        else:
            c.matcher.fill_next_token_bitmask(bitmask, i)
    idx = torch.tensor([r for r, _ in rows], dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx).float()
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device), vocab_size=vocab)
    logits.index_copy_(0, idx, sub.to(logits.dtype))
