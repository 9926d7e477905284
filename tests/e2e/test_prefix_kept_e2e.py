"""A prompt's second request finds its prefix cached, through a real stack (tiny model, CPU; one
engine_paged and one engine_prefix worker) and the official openai SDK with no session header: the
engine choice is a cost (gateway/routing/policy.py, step 5), and leaving the paged worker that served the first
request would cost the prefix's re-prefill. Before, turn 2 of an anonymous chat (and request 2 of a shared
system prompt) moved to engine_prefix and was prefilled again from scratch (cached_tokens 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from duet_stack import model_dir

from loadtests.experiments.stack import ServingStack

MODEL = model_dir().name


def _system(topic: str) -> str:
    # about 360 tokens with the tiny model's tokenizer: 22 full blocks of 16
    # (the topic first: the two tests' prompts share no block)
    return f"{topic}: you are its careful assistant. " + " ".join(f"rule{i}" for i in range(85))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with ServingStack(model_dir(), ["paged", "prefix"], {}, log_dir=tmp_path_factory.mktemp("stack")) as stack:
        yield openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, str, int, int, str]:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                           temperature=0)
    out = raw.parse()
    details = out.usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return (raw.headers["x-duet-worker"], raw.headers["x-duet-route-reason"], out.usage.prompt_tokens, cached,
            out.choices[0].message.content)


@pytest.mark.timeout(600)
def test_an_anonymous_three_turn_chat_hits_the_cache_on_its_second_turn(client):
    messages = [{"role": "system", "content": _system("Travel agency")},
                {"role": "user", "content": "Where should I go in May?"}]
    worker1, reason1, prompt1, cached1, reply = _chat(client, messages)
    assert reason1 == "reuse_low" and cached1 == 0 and prompt1 > 300
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And in June?"}]
    worker2, reason2, _, cached2, reply = _chat(client, messages)
    # the paged worker's automatic prefix cache holds turn 1's prompt: turn 2 stays and reuses it
    assert (worker2, reason2) == (worker1, "prefix_held")
    assert cached2 >= prompt1 - 32, f"turn 2 cached {cached2} of turn 1's {prompt1} prompt tokens"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks."}]
    worker3, _, _, cached3, _ = _chat(client, messages)
    assert worker3 == worker1 and cached3 >= cached2


@pytest.mark.timeout(600)
def test_a_shared_system_prompt_hits_the_cache_on_its_second_request(client):
    system = _system("Bank support desk")
    results = [_chat(client, [{"role": "system", "content": system}, {"role": "user", "content": question}])
               for question in ("How do I open an account?", "What are your fees?", "Can I close a card?")]
    (worker1, reason1, _, cached1, _), (worker2, reason2, _, cached2, _), (_, _, _, cached3, _) = results
    assert reason1 == "reuse_low" and cached1 == 0
    assert (worker2, reason2) == (worker1, "prefix_held")
    assert cached2 >= 320 and cached3 >= 320, f"cached {cached2}, {cached3} of a ~360-token system prompt"
