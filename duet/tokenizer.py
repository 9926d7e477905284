"""Tokenizer and chat template of a checkpoint directory, without transformers or torch.

`Tokenizer.from_dir(path)` loads `tokenizer.json` through the `tokenizers` library and the chat
template from `chat_template.jinja` (preferred, the transformers 5 layout) or from the
`chat_template` field of `tokenizer_config.json`. Rendering follows transformers: a sandboxed
jinja2 environment with trim_blocks and lstrip_blocks, the special tokens (`bos_token`,
`eos_token`, ...) in the context, `raise_exception`, a `tojson` that does not escape HTML,
`strftime_now`, loop controls and the `{% generation %}` tag. Token ids, rendered prompts and
decoded text equal transformers' own for the same directory (tests/duet check it).

Errors: TokenizerError for unreadable files; ChatTemplateError (also a TokenizerError, both
ValueError) for messages that are not a chat or that the template rejects, with the reason.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable, or a text cannot be tokenized."""


class ChatTemplateError(TokenizerError):
    """The messages are not a valid chat, or the chat template refused them (raise_exception)."""


class Tokenizer:
    """Encode, decode and render chats. Thread-safe for reading; holds no per-request state."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        # Only tokens that are set: jinja would render a None as the text "None".
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.bos_token_id = self._token_id("bos_token")
        self.pad_token_id = self._token_id("pad_token")
        eos = (self._token_id("eos_token"),) + tuple(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        self.special_token_ids = frozenset(
            tid for tid, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path).expanduser()
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"missing file tokenizer.json in {str(root)!r}")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise TokenizerError(f"cannot load {tok_file}: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"), root / "tokenizer_config.json")
        special = {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS}
        # The model's eos ids (config.json, generation_config.json) end generation too, e.g. <|im_end|>.
        extra: list[int] = []
        for name in ("config.json", "generation_config.json"):
            value = _read_json(root / name).get("eos_token_id")
            extra += value if isinstance(value, list) else [value] if isinstance(value, int) else []
        return cls(tok, chat_template=template, special_tokens=special, extra_eos_token_ids=tuple(extra))

    @property
    def raw(self):
        """The `tokenizers.Tokenizer` underneath (duet.detokenizer streams with its DecodeStream)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text to encode must be a string, got {type(text).__name__}")
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the Rust side refuses a str it cannot turn into UTF-8 (a lone surrogate)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TokenizerError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None
            raise


    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level form, e.g. "Ġthe"), or None for an unknown id."""
        return self._tok.id_to_token(token_id)

    @property
    def template_takes_tools(self) -> bool:
        """The chat template renders a `tools` list itself (it refers to the variable)."""
        return self.chat_template is not None and re.search(r"\btools\b", self.chat_template) is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a chat to the prompt text, as transformers' apply_chat_template(tokenize=False).

        Content given as OpenAI content parts ([{"type": "text", "text": ...}]) is joined with
        newlines first; other part types are refused.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain completion prompt instead")
        messages = _validate_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ChatTemplateError("tools must be a list of JSON objects")
        context = {**self.special_tokens, **template_kwargs}
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; special tokens come from the template, none are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs))

    def _token_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self._tok.token_to_id(text)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & for HTML; chat templates want the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        elif content is None:
            if role != "assistant" or not message.get("tool_calls"):
                raise ChatTemplateError(f"messages[{i}].content is missing")
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**message, "content": content})
    return out


def _join_text_parts(parts: list[Any], i: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {file}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # Older configs store special tokens as serialized AddedToken objects.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any, where: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    # A list of named templates: the one named "default" is the chat template.
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item.get("name") == "default" and isinstance(item.get("template"), str):
                return item["template"]
        return None
    raise TokenizerError(f"{where}: chat_template must be a string or a list of named templates")
