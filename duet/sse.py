"""`SseReader`: the data of each server-sent event of an OpenAI-style stream, up to its `[DONE]`.

The one SSE reader behind the gateway's external backends (gateway/backends/http_backend.py) and the benchmark
client (loadtests/load/client.py). It reads lines (httpx's `aiter_lines()` already splits chunks into
lines, whatever the reads) and frames them as the SSE spec does: `data:` lines of one event are joined
with newlines and the event ends at a blank line; comments (`:` lines) and the other fields (`event:`,
`id:`, `retry:`) are skipped. Unlike the spec, an event still open when the stream ends is yielded, not
dropped: a server that omits the last blank line loses nothing, and a cut JSON payload fails loudly in
the caller's `json.loads` instead of vanishing.

`SseReader.from_bytes(chunks)` reads the raw body instead (aiohttp's `content.iter_any()`, httpx's
`aiter_bytes()`), splitting lines itself (`\n`, `\r\n` or `\r`, as httpx does) and handling every line a read
brought in one pass, in one async generator from the reads to the events: through `aiter_lines()` each line climbed
three more async generators (text decoding, line splitting, this reader's own), 0.1-0.3 ms of the ~5.3 ms of CPU
httpx spent reading a 16-token stream, and a generator layer is a step more at every token's wake-up
(docs/benchmarks.md).

`[DONE]` ends the iteration and sets `done`; a stream that ends without it leaves `done` False, which a
caller that needs the marker (a backend cut mid-answer) turns into its error.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

DONE = "[DONE]"


class SseReader:
    def __init__(self, lines: AsyncIterable[str]) -> None:
        self._lines = lines
        self._chunks: AsyncIterable[bytes] | None = None  # `from_bytes`: the raw reads instead of lines
        self.done = False  # True once the `[DONE]` event was read

    @classmethod
    def from_bytes(cls, chunks: AsyncIterable[bytes]) -> SseReader:
        """The events of a raw body's reads, cut anywhere (module doc)."""
        reader = cls(())
        reader._chunks = chunks
        return reader

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events(self._lines) if self._chunks is None else self._events_of_reads(self._chunks)

    async def _events(self, lines: AsyncIterable[str]) -> AsyncIterator[str]:
        data: list[str] = []
        async for line in lines:
            payload = _feed(line, data)
            if payload is not None:
                if payload.strip() == DONE:
                    self.done = True
                    return
                yield payload
        payload = _feed("", data)  # the stream's end dispatches an event still open
        if payload is not None:
            if payload.strip() == DONE:
                self.done = True
                return
            yield payload

    async def _events_of_reads(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
        """`_events` over the complete lines of each read (UTF-8), their endings cut; a line's rest waits for the
        next read, and so does a read's last `\r` (its `\n` may open the next read). One generator from the raw
        reads to the events: it runs once per token a backend streams, and each generator layer more was a step
        more at every wake-up (docs/benchmarks.md, the gateway's CPU per request)."""
        data: list[str] = []
        rest = b""
        async for chunk in chunks:
            lines = (rest + chunk).splitlines(keepends=True)  # bytes split on \n, \r\n and \r only
            rest = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
            for line in lines:
                payload = _feed(line.decode("utf-8", "replace"), data)
                if payload is not None:
                    if payload.strip() == DONE:
                        self.done = True
                        return
                    yield payload
        for line in ((rest.decode("utf-8", "replace"),) if rest else ()) + ("",):  # the end dispatches an open event
            payload = _feed(line, data)
            if payload is not None:
                if payload.strip() == DONE:
                    self.done = True
                    return
                yield payload


def _feed(line: str, data: list[str]) -> str | None:
    """One line into the open event's `data` lines (emptied when it ends): the event's payload when this line,
    blank, ends an event that has data; comments (`:` lines) and the other fields are skipped."""
    line = line.rstrip("\r\n")
    if line:
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
        return None
    if not data:
        return None
    payload = "\n".join(data)
    data.clear()
    return payload
