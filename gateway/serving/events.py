"""What a run says: the typed events every API renders its answer from.

gateway/serving/runs.py `Run.events()` yields, per engine message, the list of events it made (empty while
nothing is visible yet: an incomplete character, a held-back stop or tag prefix). Each event names its
choice (`n` > 1 has several). The chat/completion chunks (gateway/serving/chat_chunks.py), the Responses
API and the Messages API (gateway/api/) each render these; none reads another API's shapes.

    Content(text, choice, logprobs)     more of the answer's text; `logprobs` (when asked) are those of
                                        the tokens that came in this message (text may then be "")
    CallStart(index, id, name, choice)  a tool call begins (`index`: its place among the choice's calls)
    Arguments(index, text, choice)      more of that call's arguments (JSON text; the pieces concatenate)
    Finish(choice, reason, stop_sequence, usage)
                                        the choice ended: stop | length | tool_calls, the stop string that
                                        ended it, and the request's usage (all of it once every choice ended)

`answer(events, choice)` folds one choice's events into what a whole (non-streamed) answer holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt's, served from the engine's prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the token's own text (special tokens included)
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the best alternatives (text, logprob), as many as asked


@dataclass(frozen=True)
class Content:
    text: str
    choice: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str
    choice: int = 0


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str
    choice: int = 0


@dataclass(frozen=True)
class Finish:
    choice: int
    reason: str  # stop | length | tool_calls
    stop_sequence: str | None
    usage: Usage


Event = Content | CallStart | Arguments | Finish


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Answer:
    """One choice, whole: its text (stripped when it made tool calls: what surrounds calls is not the
    answer's body), its calls, the logprobs of all its tokens and how it ended."""

    text: str
    calls: tuple[ToolCall, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish: Finish | None


def answer(events, choice: int = 0) -> Answer:
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    starts: dict[int, CallStart] = {}
    arguments: dict[int, list[str]] = {}
    finish = None
    for e in events:
        if e.choice != choice:
            continue
        if isinstance(e, Content):
            text.append(e.text)
            logprobs.extend(e.logprobs)
        elif isinstance(e, CallStart):
            starts[e.index], arguments[e.index] = e, []
        elif isinstance(e, Arguments):
            arguments[e.index].append(e.text)
        else:
            finish = e
    calls = tuple(ToolCall(starts[i].id, starts[i].name, "".join(arguments[i])) for i in sorted(starts))
    whole = "".join(text)
    return Answer(whole.strip() if calls else whole, calls, tuple(logprobs), finish)
