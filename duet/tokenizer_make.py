"""A deterministic byte-level BPE tokenizer for the random-weight checkpoints.

`build_tokenizer_json(vocab_size)` returns the text of a `tokenizer.json` that the `tokenizers`
library and transformers both load. It is byte-level (every UTF-8 string encodes, any token
sequence decodes), NFC-normalized and pre-split like Qwen2's, and starts with three special tokens:
`<|endoftext|>` (0, eos and pad), `<|im_start|>` (1), `<|im_end|>` (2).

The training corpus is built in: a few hand-written lines of English, Chinese, code and emoji,
plus pseudo-words drawn by a seeded numpy generator so the larger vocabularies have enough
distinct pairs to merge. Same `vocab_size` -> same bytes (a test checks it across processes).
"""

from __future__ import annotations

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2's pre-tokenizer split (the public pattern in its tokenizer.json). transformers rebuilds this
# pre-tokenizer for any qwen2 model whatever tokenizer.json says, so using it everywhere keeps the
# `tokenizers` library and transformers in agreement for every arch we make.
_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

_SEED_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Large language models predict the next token. The cache keeps keys and values for every layer.
Please summarize the following document in three sentences. Answer the question briefly.
User: Can you help me write a poem about the sea? Assistant: Of course. The sea is wide and deep.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828 -1 +7 50% $19.99
你好，世界！今天天气很好。我们一起去公园散步吧。机器学习是人工智能的一个分支。
大语言模型可以回答问题、写代码和翻译文章。请用中文回答下面的问题。谢谢你的帮助。
北京是中国的首都。上海是一个大城市。春天来了，花开了。我喜欢读书和听音乐。
こんにちは、世界。ありがとうございます。안녕하세요. Привет, мир! Bonjour le monde. ¡Hola, señor!
Emoji: 😀 😃 😄 😁 😂 🤣 🙂 🙃 😉 😊 😇 🥰 😍 🤩 😘 👍 👎 👋 🙏 🎉 🚀 🔥 ✨ ❤️ 💡 ✅ ❌ 🌍 🐍 🦀 👩‍💻 🇺🇸
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i}: {fibonacci(i)}")

class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

{"name": "duet", "version": "0.1.0", "tags": ["llm", "serving"], "ok": true, "count": null}
SELECT id, name FROM users WHERE age > 18 ORDER BY name;
fn main() { let x = vec![1, 2, 3]; println!("{:?}", x); }
<html><body><p>Hello</p></body></html>
"""

_SYLLABLES = ["a", "e", "i", "o", "u", "ka", "ki", "ku", "ke", "ko", "sa", "shi", "su", "se", "so", "ta", "chi", "tsu", "te", "to", "na", "ni", "nu", "ne", "no", "ha", "hi", "fu", "he", "ho", "ma", "mi", "mu", "me", "mo", "ya", "yu", "yo", "ra", "ri", "ru", "re", "ro", "wa", "n", "ba", "be", "bi", "bo", "bu", "da", "de", "di", "do", "du", "ga", "ge", "gi", "go", "gu", "la", "le", "li", "lo", "lu", "pa", "pe", "pi", "po", "pu", "th", "st", "str", "ch", "sh", "tr", "pl", "gr", "br", "cr", "fl", "ing", "ion", "er", "ed", "ly", "est", "ous", "ent", "and", "ter"]
_HAN = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理"

_CODE_WORDS = ["def", "class", "return", "import", "from", "self", "None", "True", "False", "if", "else", "elif", "for", "while", "in", "is", "not", "and", "or", "try", "except", "finally", "with", "as", "lambda", "yield", "async", "await", "print", "len", "range", "list", "dict", "set", "int", "str", "float", "const", "let", "var", "function", "=>", "{}", "[]", "()", "==", "!=", "<=", ">=", "+=", "-=", "&&", "||", "//", "/*", "*/", "#", "include", "std::vector"]


def _corpus(num_words: int) -> list[str]:
    """The training text: the seed lines, then seeded pseudo-text in four flavours."""
    rng = np.random.default_rng(20260101)
    # A Zipf-ish lexicon of pseudo-words so frequent pairs repeat and rare ones still exist.
    lexicon = []
    for _ in range(6000):
        n = int(rng.integers(1, 5))
        lexicon.append("".join(_SYLLABLES[int(j)] for j in rng.integers(0, len(_SYLLABLES), n)))
    weights = 1.0 / np.arange(1, len(lexicon) + 1)
    weights /= weights.sum()
    lines = _SEED_TEXT.splitlines() * 8
    words = rng.choice(len(lexicon), size=num_words, p=weights)
    for start in range(0, num_words, 12):
        chunk = [lexicon[int(w)] for w in words[start:start + 12]]
        if chunk and start % 5 == 0:
            chunk[0] = chunk[0].capitalize()
        lines.append(" ".join(chunk) + ".")
    han = rng.integers(0, len(_HAN), size=num_words // 2)
    for start in range(0, len(han), 20):
        lines.append("".join(_HAN[int(j)] for j in han[start:start + 20]) + "。")
    code = rng.integers(0, len(_CODE_WORDS), size=num_words // 4)
    for start in range(0, len(code), 8):
        lines.append("    " + " ".join(_CODE_WORDS[int(j)] for j in code[start:start + 8]))
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE to `vocab_size` entries (specials included)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # More text for larger vocabularies, so there are enough pairs worth merging.
    tok.train_from_iterator(_corpus(max(20_000, vocab_size * 12)), trainer=trainer)
    return tok


def build_tokenizer_json(vocab_size: int) -> str:
    return build_tokenizer(vocab_size).to_str(pretty=True)
