"""`SseReader`: the data of each server-sent event of an OpenAI-style stream, up to its `[DONE]`.

The one SSE reader behind the gateway's external backends (gateway/backends/http_backend.py) and the benchmark
client (loadtests/load/client.py). It reads lines (httpx's `aiter_lines()` already splits chunks into
lines, whatever the reads) and frames them as the SSE spec does: `data:` lines of one event are joined
with newlines and the event ends at a blank line; comments (`:` lines) and the other fields (`event:`,
`id:`, `retry:`) are skipped. Unlike the spec, an event still open when the stream ends is yielded, not
dropped: a server that omits the last blank line loses nothing, and a cut JSON payload fails loudly in
the caller's `json.loads` instead of vanishing.

`[DONE]` ends the iteration and sets `done`; a stream that ends without it leaves `done` False, which a
caller that needs the marker (a backend cut mid-answer) turns into its error.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

DONE = "[DONE]"


class SseReader:
    def __init__(self, lines: AsyncIterable[str]) -> None:
        self._lines = lines
        self.done = False  # True once the `[DONE]` event was read

    async def __aiter__(self) -> AsyncIterator[str]:
        data: list[str] = []
        async for line in _closed(self._lines):
            line = line.rstrip("\r\n")
            if line:
                name, _, value = line.partition(":")
                if name == "data":
                    data.append(value.removeprefix(" "))
                continue
            if not data:
                continue
            payload, data = "\n".join(data), []
            if payload.strip() == DONE:
                self.done = True
                return
            yield payload


async def _closed(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The lines, then one blank line: an event still open at the end is dispatched."""
    async for line in lines:
        yield line
    yield ""
