"""Streaming detokenization: no broken characters mid-stream, and the stream adds up to the full text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duet.detokenizer import IncrementalDetokenizer
from duet.tokenizer import Tokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "mixed 中文 and English, 日本語も, 한국어 too ✨",
    "plain ascii text with  double  spaces\nand lines\n",
    "  leading,   runs of spaces,\ttabs \u00a0nbsp  trailing  ",
]


@pytest.fixture(scope="module")
def tok(tiny_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dirs["llama"])


def _stream(tok: Tokenizer, ids: list[int], step: int = 1, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    chunks = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return [*chunks, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_multibyte_text_streams_whole_characters(tok: Tokenizer, text: str, step: int) -> None:
    ids = tok.encode(text)
    chunks = _stream(tok, ids, step)
    assert "".join(chunks) == text == tok.decode(ids)
    assert all("\ufffd" not in c for c in chunks)
    # A token that ends mid-character is held back, so some pushes return nothing.
    if step == 1 and any(ord(ch) > 0x7F for ch in text):
        assert "" in chunks[:-1]


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [1, *tok.encode("user\n你好"), 2, 0]
    assert "".join(_stream(tok, ids)) == "user\n你好"
    assert "".join(_stream(tok, ids, skip=False)) == "<|im_start|>user\n你好<|im_end|><|endoftext|>"


def test_incomplete_character_at_end_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte tokens in the tiny vocab
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])  # replacement characters, as a full decode gives


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 999), max_size=40), step=st.integers(1, 4), skip=st.booleans())
def test_stream_equals_full_decode_for_any_ids(tok: Tokenizer, ids: list[int], step: int, skip: bool) -> None:
    chunks = _stream(tok, ids, step, skip)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
    # Garbage bytes may decode to U+FFFD, but a push never ends on one: that could be half a character.
    assert not any(c.endswith("\ufffd") for c in chunks[:-1])


def _pieces(tok: Tokenizer, ids: list[int], step: int, skip: bool, use_decode_stream: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, use_decode_stream=use_decode_stream)
    return [*(detok.push(ids[i:i + step]) for i in range(0, len(ids), step)), detok.flush()]


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 999), max_size=40), step=st.integers(1, 4), skip=st.booleans())
def test_decode_stream_gives_the_windows_text(tok: Tokenizer, ids: list[int], step: int, skip: bool) -> None:
    """tokenizers' DecodeStream (the default for a duet Tokenizer) and the decode window give the same text
    for any ids. (Around garbage bytes the stream may release a special token one push earlier than the
    window, which holds it with the incomplete character after it.)"""
    assert "".join(_pieces(tok, ids, step, skip, True)) == "".join(_pieces(tok, ids, step, skip, False))


@pytest.mark.parametrize("text", TEXTS)
def test_decode_stream_gives_the_windows_pieces_on_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert _pieces(tok, ids, 1, True, True) == _pieces(tok, ids, 1, True, False)
