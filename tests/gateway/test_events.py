"""The one-way request path: a run says its answer once, as typed events (gateway/serving/events.py), and
each API renders those; none parses another API's shapes. And a client that leaves a whole (non-streamed)
answer leaves nothing behind: no engine call, no pending slot, no task with an error nobody read."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from types import SimpleNamespace

import pytest

from gateway.api import messages, responses
from gateway.serving import runs
from gateway.serving.events import Arguments, CallStart, Content, Finish, Usage, answer
from tests.gateway.test_layers import GATEWAY, imported
from tests.support.fake_engine import Fail, FakeEngine, Hang, Sim
from tests.support.stack import model_dir

MODEL = model_dir().name
EVENT_TYPES = (Content, CallStart, Arguments, Finish)

# Each API's rendering, and the serving modules that render one API's shapes (the chat/completion chunks)
RENDERS = {"gateway.api.completions": "openai", "gateway.api.completion_batch": "openai",
           "gateway.serving.chat_chunks": "openai", "gateway.api.responses": "responses",
           "gateway.api.messages": "messages"}


def test_no_api_imports_another_api_s_rendering():
    found = []
    for module, api in RENDERS.items():
        path = GATEWAY.parent / (module.replace(".", "/") + ".py")
        for name in imported(path.read_text(), module):
            if RENDERS.get(name, api) != api:
                found.append(f"{module} imports {name}")
    assert found == []


@pytest.mark.parametrize("module", ["gateway.api.responses", "gateway.api.messages"])
def test_responses_and_messages_read_no_chat_chunk_fields(module):
    source = (GATEWAY.parent / (module.replace(".", "/") + ".py")).read_text()
    for read in ('["choices"]', '["delta"]', '["message"]', '["function"]', 'get("tool_calls")', 'get("content")',
                 ".builder", ".steps("):
        assert read not in source, f"{module} reads {read} of a chat answer"


def _recorded(monkeypatch) -> list:
    """Every list `Run.events()` yields from now on (the streams)."""
    seen: list = []
    original = runs.Run.events

    async def events(self):
        async with contextlib.aclosing(original(self)) as steps:
            async for step in steps:
                seen.append(step)
                yield step

    monkeypatch.setattr(runs.Run, "events", events)
    return seen


def _sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of an `event:`/`data:` stream."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: "):])))
    return out


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
async def test_a_stream_is_what_the_run_s_typed_events_say(fake_gateway, monkeypatch, path):
    seen = _recorded(monkeypatch)
    gw = await fake_gateway(FakeEngine("prefix"))
    body = {"model": MODEL, "max_tokens": 12, "stream": True}
    if path == "/v1/responses":
        body = {"model": MODEL, "max_output_tokens": 12, "stream": True, "input": "tell me", "store": False}
    else:
        body["messages"] = [{"role": "user", "content": "tell me"}]
    r = await gw.http.post(path, json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert seen and all(isinstance(step, list) and all(isinstance(e, EVENT_TYPES) for e in step) for step in seen)
    said = answer([e for step in seen for e in step])
    assert said.finish is not None and said.finish.reason == "length" and said.finish.usage.completion_tokens == 12
    assert said.text  # the sim says something
    events = _sse(r.text) if path != "/v1/chat/completions" else [
        (None, json.loads(ln[6:])) for ln in r.text.splitlines() if ln.startswith("data: {")]
    if path == "/v1/messages":
        streamed = "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
        assert [d["delta"]["stop_reason"] for name, d in events if name == "message_delta"] == ["max_tokens"]
    elif path == "/v1/responses":
        streamed = "".join(d["delta"] for name, d in events if name == "response.output_text.delta")
        final = next(d["response"] for name, d in events if name == "response.completed")
        assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 12
    else:
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for _, c in events)
    assert streamed == said.text


class _ScriptedRun:
    """A run whose events a test writes: what a renderer gets from the serving path, and nothing else."""

    def __init__(self, *steps: list) -> None:
        self.steps = steps
        self.usage = Usage(prompt_tokens=10, completion_tokens=0, cached_tokens=4)

    async def events(self):
        for step in self.steps:
            yield step


USAGE = Usage(prompt_tokens=10, completion_tokens=7, cached_tokens=4)
CALL_STEPS = ([Content("Let me check.")], [CallStart(0, "call_1", "get_weather"), Arguments(0, '{"city": ')],
              [Arguments(0, '"Paris"}'), Finish(0, "tool_calls", None, USAGE)])


async def _body(stream) -> str:
    return b"".join([part async for part in stream]).decode()


async def test_messages_renders_typed_events():
    events = _sse(await _body(messages._events(_ScriptedRun(*CALL_STEPS), "msg_1", "m")))
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": 6, "output_tokens": 0, "cache_read_input_tokens": 4,
                                                "cache_creation_input_tokens": 0}
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert "".join(d["delta"]["partial_json"] for _, d in events[5:7]) == '{"city": "Paris"}'
    assert events[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[8][1]["usage"] == {"output_tokens": 7}


async def test_responses_renders_typed_events():
    rr = SimpleNamespace(store=False, echo={}, conversation=[])
    reply = responses._Reply(None, rr, "r1", "m", "resp_r1")
    events = _sse(await _body(responses._events(_ScriptedRun(*CALL_STEPS), reply)))
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    assert final["output"][1] | {"id": None} == {"type": "function_call", "id": None, "call_id": "call_1",
                                                 "name": "get_weather", "arguments": '{"city": "Paris"}',
                                                 "status": "completed"}
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4} and final["usage"]["output_tokens"] == 7
    deltas = [d["delta"] for name, d in events if name == "response.function_call_arguments.delta"]
    assert deltas == ['{"city": ', '"Paris"}']


@pytest.fixture
async def loop_errors():
    """What the event loop reports: an exception nobody retrieved (of a task or a gathering future)."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    yield reported
    loop.set_exception_handler(previous)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
async def test_a_client_leaving_a_whole_answer_leaves_no_call_no_slot_and_no_unread_error(fake_gateway, loop_errors,
                                                                                         path):
    engine = FakeEngine("prefix", ms_per_token=20.0)
    gw = await fake_gateway(engine)
    body = {"model": MODEL, "max_tokens": 500, "messages": [{"role": "user", "content": "hello"}]}
    if path == "/v1/responses":
        body = {"model": MODEL, "max_output_tokens": 500, "input": "hello", "store": False}
    status, chunks = await gw.request_and_leave(path, body, leave_after_chunks=0)
    assert (status, chunks) == (499, [])
    assert engine.cancelled == 1 and not engine.open_streams
    assert gw.gateway.pending.count == 0
    await asyncio.sleep(0.05)  # let every cancelled task end
    gc.collect()
    assert loop_errors == []


async def test_a_batch_prompt_failing_stops_the_others_and_leaves_no_unread_error(fake_gateway, loop_errors):
    engine = FakeEngine("prefix")
    gw = await fake_gateway(engine)
    engine.script([Sim(3), Fail("UNAVAILABLE", "worker went away")], [Sim(2), Hang()])
    r = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "two"], "max_tokens": 20})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == f"worker {engine.worker_id} failed mid-stream: UNAVAILABLE: worker went away"
    assert not engine.open_streams and gw.gateway.pending.count == 0  # the hanging prompt's call was cancelled
    await asyncio.sleep(0.05)
    gc.collect()
    assert loop_errors == []
