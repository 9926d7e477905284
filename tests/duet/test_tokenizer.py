"""Tokenizer and chat template: equal to transformers' AutoTokenizer on the checkpoints we make."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from duet.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界！今天天气很好。",
    "Emoji 😀👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n",
    "  leading and trailing spaces   \n\n\n",
    "façade naïve Ångström ﬁ Ａ",  # NFC/compat characters
    "special text <|im_start|>user\nhi<|im_end|> inside",
    "rare bytes \x00\x01\x7f and \u200b zero width",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are a helpful 助手."},
        {"role": "user", "content": "写一首诗 about the sea 🌊"},
        {"role": "assistant", "content": "The sea is wide."},
        {"role": "user", "content": "Again, <b>shorter</b> & sweeter."},
    ],
]

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now> & 明天",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> tuple[Tokenizer, object]:
    # qwen2 dirs load as transformers' Qwen2Tokenizer, llama as the generic backend: check both.
    path = tiny_dirs[request.param]
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(pair: tuple, text: str) -> None:
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    with_specials = [1, *ids, 2, 0]
    assert ours.decode(with_specials, skip_special_tokens=False) == theirs.decode(with_specials)
    assert ours.decode(with_specials) == theirs.decode(with_specials, skip_special_tokens=True)


def test_any_utf8_round_trips(tiny_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(tiny_dirs["llama"])
    for text in TEXTS[:-1]:
        if "<|" not in text:
            assert tok.decode(tok.encode(text)) == __import__("unicodedata").normalize("NFC", text)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_equals_transformers(pair: tuple, messages: list, add_generation_prompt: bool,
                                           tools: list | None) -> None:
    ours, theirs = pair
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    assert text == theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, tokenize=False
    )
    ids = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     tokenize=True, return_dict=False)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools) == list(ids)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_special_tokens_and_ids(tiny_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(tiny_dirs["qwen3"])
    assert tok.vocab_size == 1000
    assert tok.eos_token_ids == (0, 2)  # <|endoftext|> from the tokenizer, <|im_end|> from the model config
    assert tok.pad_token_id == 0 and tok.bos_token_id is None
    assert tok.special_token_ids == {0, 1, 2}
    assert tok.encode_chat([{"role": "user", "content": "x"}])[0] == tok.token_to_id("<|im_start|>") == 1


def _dir_with_template(tmp_path: Path, src: Path, template: str, where: str) -> Path:
    path = tmp_path / "m"
    shutil.copytree(src, path)
    if where == "jinja":
        (path / "chat_template.jinja").write_text(template)
    else:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


# Uses eos_token from the context, strftime_now, tojson with options, loop controls, {% generation %}.
RICH_TEMPLATE = """{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% if m.role == 'assistant' %}{% generation %}[A] {{ m.content }}{{ eos_token }}{% endgeneration %}
  {% else %}[{{ m.role | upper }}] {{ m.content }}
  {% endif %}
{% endfor %}
{{ {'k': '<&>', 'z': 1, 'a': [1, 2]} | tojson(sort_keys=True) }}
{% if add_generation_prompt %}[A] {% endif %}"""


@pytest.mark.parametrize("where", ["jinja", "config"])
def test_template_features_equal_transformers(tmp_path: Path, tiny_dirs: dict[str, Path], where: str) -> None:
    path = _dir_with_template(tmp_path, tiny_dirs["llama"], RICH_TEMPLATE, where)
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hi"}, {"role": "skip", "content": "-"},
                {"role": "assistant", "content": "yo"}]
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '{"a": [1, 2], "k": "<&>", "z": 1}' in text and "yo<|endoftext|>" in text


def test_chat_template_jinja_file_wins_over_config(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _dir_with_template(tmp_path, tiny_dirs["llama"], "FILE {{ messages[0].content }}", "jinja")
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE x"


def test_strftime_now_renders(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _dir_with_template(tmp_path, tiny_dirs["llama"], "{{ strftime_now('%Y') }}", "jinja")
    year = Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])
    assert year.isdigit() and len(year) == 4


def test_text_parts_are_joined(tiny_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(tiny_dirs["llama"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\].role"),
        ([{"role": "user"}], r"messages\[0\].content is missing"),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts.*image_url"),
        ([{"role": "wizard", "content": "x"}], "Unknown role: wizard"),  # the template's raise_exception
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "system message must come first"),
    ],
)
def test_bad_messages_are_clear_errors(tiny_dirs: dict[str, Path], messages: object, message: str) -> None:
    tok = Tokenizer.from_dir(tiny_dirs["llama"])
    with pytest.raises(ChatTemplateError, match=message):
        tok.apply_chat_template(messages)


def test_missing_or_broken_files(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(TokenizerError, match="missing file tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    path = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"], path)
    (path / "tokenizer_config.json").unlink()
    no_template = Tokenizer.from_dir(path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_dir(path)


def test_template_syntax_error_is_clear(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    path = _dir_with_template(tmp_path, tiny_dirs["llama"], "{% for %}", "jinja")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


def test_bench_tokenizer_equals_transformers(bench_dir: Path) -> None:
    ours, theirs = Tokenizer.from_dir(bench_dir), transformers.AutoTokenizer.from_pretrained(bench_dir)
    assert ours.vocab_size == 8000
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode_chat(CHATS[1]) == list(theirs.apply_chat_template(CHATS[1], add_generation_prompt=True,
                                                                          return_dict=False))
