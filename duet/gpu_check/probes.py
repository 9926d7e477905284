"""What a user of the official openai SDK would try first against a served model, each checked as they would.

chat; streaming with usage; a json_schema response that parses and fits; `n` choices with a seed, the same twice;
a prompt of about 4k tokens (less when the model's context is shorter: the record says how many); a second turn
whose prompt is partly cached; and that both engine kinds answered (the gateway names the one that served in
the `x-duet-engine` header: json_schema goes to engine_prefix, `n` to engine_paged). Each probe's record:
passed or failed with why, seconds, the engine kind, what it measured.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

LONG_PROMPT_TOKENS = 4096
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "level"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "level": {"enum": [1, 2, 3]}}}
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank at dawn. "


class ProbeFailed(AssertionError):
    """A probe's answer is not what a user would accept; the message says what was wrong."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ProbeFailed(message)


class Probes:
    def __init__(self, base_url: str, timeout_s: float = 90.0):
        from openai import OpenAI

        # the first request to each worker compiles its kernels (on a GPU): a long timeout, few retries
        self.client = OpenAI(base_url=base_url, api_key="gpu-check", timeout=timeout_s, max_retries=1)
        model = self.client.models.list().data[0]
        self.model = model.id
        self.max_model_len = int((model.model_extra or {}).get("max_model_len") or LONG_PROMPT_TOKENS + 512)
        self.engines: list[str] = []

    def _create(self, **kw):
        raw = self.client.chat.completions.with_raw_response.create(model=self.model, **kw)
        engine = raw.headers.get("x-duet-engine", "?")
        self.engines.append(engine)
        return raw.parse(), engine

    def chat(self) -> dict:
        r, engine = self._create(messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0)
        c = r.choices[0]
        _check(isinstance(c.message.content, str) and c.finish_reason in ("stop", "length"),
               f"content {c.message.content!r}, finish_reason {c.finish_reason!r}")
        _check(1 <= r.usage.completion_tokens <= 16, f"usage.completion_tokens {r.usage.completion_tokens}")
        return {"engine": engine, "completion_tokens": r.usage.completion_tokens, "finish_reason": c.finish_reason}

    def stream_usage(self) -> dict:
        start = time.monotonic()
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16,
            temperature=0, stream=True, stream_options={"include_usage": True})
        engine = raw.headers.get("x-duet-engine", "?")
        self.engines.append(engine)
        first, text, usage, chunks = None, "", None, 0
        for chunk in raw.parse():
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic() - start
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
                _check(not chunk.choices, "the usage chunk also carries choices")
        _check(usage is not None, "no usage chunk at the end of the stream")
        _check(usage.completion_tokens >= 1 and bool(text), f"text {text!r}, usage {usage}")
        return {"engine": engine, "chunks": chunks, "ttft_s": round(first or 0.0, 4),
                "completion_tokens": usage.completion_tokens}

    def json_schema(self) -> dict:
        r, engine = self._create(
            messages=[{"role": "user", "content": "Is the sky blue? Answer as JSON."}], max_tokens=64, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
        content = r.choices[0].message.content
        try:
            value = json.loads(content)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ProbeFailed(f"not JSON ({exc}): {content!r}") from exc
        _check(isinstance(value, dict) and set(value) == {"answer", "level"} and value["answer"] in ("yes", "no")
               and value["level"] in (1, 2, 3), f"does not fit the schema: {value!r}")
        return {"engine": engine, "content": content}

    def n_with_seed(self) -> dict:
        kw = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "n": 3, "seed": 1234,
              "temperature": 1.0}
        first, engine = self._create(**kw)
        second, _ = self._create(**kw)
        texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
        again = [c.message.content for c in sorted(second.choices, key=lambda c: c.index)]
        _check([c.index for c in first.choices] == [0, 1, 2], f"choice indexes {[c.index for c in first.choices]}")
        _check(texts == again, f"the same seed gave {texts!r} then {again!r}")
        return {"engine": engine, "distinct_choices": len(set(texts))}

    def long_prompt(self) -> dict:
        target = min(LONG_PROMPT_TOKENS, self.max_model_len - 64)
        # tokens per sentence, measured: a prompt of 8 sentences and one of 40
        sizes = [self._create(messages=[{"role": "user", "content": SENTENCE * k}], max_tokens=1)[0].usage.prompt_tokens
                 for k in (8, 40)]
        per = (sizes[1] - sizes[0]) / 32
        count = int((target - (sizes[0] - 8 * per)) // per) - 2  # room for the opening line below
        # an opening line of its own, so no page of this prompt is cached from the two above: a cold prefill
        content = f"Request {time.time_ns()}. " + SENTENCE * count
        start = time.monotonic()
        r, engine = self._create(messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
        seconds = time.monotonic() - start
        _check(0.9 * target <= r.usage.prompt_tokens <= target, f"{r.usage.prompt_tokens} prompt tokens for {target}")
        _check(r.usage.completion_tokens >= 1, f"usage.completion_tokens {r.usage.completion_tokens}")
        details = r.usage.prompt_tokens_details
        return {"engine": engine, "prompt_tokens": r.usage.prompt_tokens, "target_tokens": target,
                "cached_tokens": (details.cached_tokens or 0) if details else 0,
                "max_model_len": self.max_model_len, "request_s": round(seconds, 3)}

    def cached_second_turn(self) -> dict:
        messages = [{"role": "system", "content": "You answer briefly. " + SENTENCE * 12},
                    {"role": "user", "content": "What did the fox do?"}]
        first, engine = self._create(messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
        second, engine2 = self._create(messages=messages, max_tokens=8, temperature=0)
        details = second.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        _check(cached > 0, f"second turn: 0 of {second.usage.prompt_tokens} prompt tokens cached")
        return {"engines": [engine, engine2], "prompt_tokens": second.usage.prompt_tokens, "cached_tokens": cached}

    def both_engine_kinds(self) -> dict:
        seen = sorted(set(self.engines))
        _check({"paged", "prefix"} <= set(seen), f"only {seen} answered")
        return {"engines": seen, "requests": len(self.engines)}

    def all(self) -> list[tuple[str, Callable[[], dict]]]:
        return [("chat", self.chat), ("stream_usage", self.stream_usage), ("json_schema", self.json_schema),
                ("n_with_seed", self.n_with_seed), ("long_prompt", self.long_prompt),
                ("cached_second_turn", self.cached_second_turn), ("both_engine_kinds", self.both_engine_kinds)]


def run_probes(base_url: str) -> dict[str, dict]:
    """Every probe, in order; one that fails does not stop the others."""
    probes = Probes(base_url)
    results: dict[str, dict] = {}
    for name, probe in probes.all():
        start = time.monotonic()
        try:
            result = {"status": "passed", **probe()}
        except Exception as exc:  # noqa: BLE001 - ProbeFailed or the SDK's error: recorded, the next probe runs
            result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:1000]}
        results[name] = {**result, "seconds": round(time.monotonic() - start, 3)}
    return results
