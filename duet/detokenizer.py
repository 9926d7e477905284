"""Incremental detokenization for streaming: token ids in, new text out, never half a character.

A token of a byte-level BPE can end in the middle of a UTF-8 character (one Chinese character or
emoji often spans two or three tokens). Decoding each token alone would emit U+FFFD garbage, and
decoding the whole sequence at every step costs O(n) per token. Instead the detokenizer decodes a
short window: the tokens since `prefix_offset` (already emitted, kept as context so tokenizers that
strip or merge spaces decode them the same way as in the full text) and the tokens since
`read_offset` (not yet emitted). New text is released only when the window no longer ends in a
replacement character, i.e. once the pending bytes complete a character.

Contract: the concatenation of every `push` result and the final `flush` equals
`tokenizer.decode(all_ids, skip_special_tokens)` for byte-level tokenizers.

A tokenizer that exposes its `tokenizers.Tokenizer` (`raw`, as duet.tokenizer.Tokenizer does) is
decoded by that library's own streaming decoder, `tokenizers.decoders.DecodeStream`, which keeps the
same window in Rust and gives the same pieces (tests/duet/test_detokenizer.py checks piece for piece,
on the tiny vocabulary and on SmolLM2's); `flush` still decodes the held-back tail itself (the
stream has no way to give up its pending bytes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One per output stream; not thread-safe."""

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True, use_decode_stream: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (already emitted)
        self._read_offset = 0  # first token whose text is not emitted yet
        self._raw = getattr(tokenizer, "raw", None) if use_decode_stream else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._raw is not None else None

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text they complete ("" while a character is still incomplete)."""
        start = len(self._ids)
        self._ids.extend(token_ids)
        if self._stream is not None:
            pieces = []
            for k in range(start, len(self._ids)):
                piece = self._stream.step(self._raw, self._ids[k])
                if piece:  # the same offsets the window below keeps, so that flush() continues from them
                    pieces.append(piece)
                    self._prefix_offset, self._read_offset = self._read_offset, k + 1
            return "".join(pieces)
        if len(self._ids) == self._read_offset:
            return ""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        if len(window) <= len(emitted) or window.endswith(_REPLACEMENT):
            # Incomplete character (or nothing visible yet, e.g. a skipped special token): wait.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(emitted):]

    def flush(self) -> str:
        """At end of stream: whatever is still pending, replacement characters included."""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return window[len(emitted):]

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)
