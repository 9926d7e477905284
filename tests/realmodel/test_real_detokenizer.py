"""On SmolLM2's tokenizer, tokenizers' own streaming decoder (DecodeStream, what duet.detokenizer uses for a
duet Tokenizer) gives the decode window's pieces, piece for piece, one token at a time (and the same text in batches, where
the stream may release a batch's text in more pieces)."""

from __future__ import annotations

import pytest

from duet.detokenizer import IncrementalDetokenizer
from duet.tokenizer import Tokenizer

TEXTS = ["The capital of France is Paris.", "你好，世界！今天天气很好。", "Emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
         "mixed 中文 and English, 日本語も, 한국어 ✨", "def f(x):\n    return x  # done\n",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
         "  two  spaces,   three,\ttab \u00a0nbsp  trailing  ", "café naïve Ωmega ∑ “quotes” — dash…"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_decode_stream_equals_the_window_on_smollm2(smollm2_dir, text, step):
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode(text)
    for skip in (True, False):
        got = {}
        for use in (True, False):
            d = IncrementalDetokenizer(tok, skip_special_tokens=skip, use_decode_stream=use)
            got[use] = [*(d.push(ids[i:i + step]) for i in range(0, len(ids), step)), d.flush()]
        assert got[True] == got[False] if step == 1 else "".join(got[True]) == "".join(got[False])
        assert "".join(got[True]) == tok.decode(ids, skip_special_tokens=skip)
