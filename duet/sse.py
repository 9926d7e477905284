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
brought in one pass: through
`aiter_lines()` each line climbs three more async generators (text decoding, line splitting, this reader's own):
0.1-0.3 ms of the ~5.3 ms of CPU httpx spends reading a 16-token stream (docs/benchmarks.md).

`[DONE]` ends the iteration and sets `done`; a stream that ends without it leaves `done` False, which a
caller that needs the marker (a backend cut mid-answer) turns into its error.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

DONE = "[DONE]"


class SseReader:
    def __init__(self, lines: AsyncIterable[str]) -> None:
        self._batches: AsyncIterable[list[str]] = _one_each(lines)
        self.done = False  # True once the `[DONE]` event was read

    @classmethod
    def from_bytes(cls, chunks: AsyncIterable[bytes]) -> SseReader:
        """The events of a raw body's reads, cut anywhere (module doc)."""
        reader = cls(())
        reader._batches = _line_batches(chunks)
        return reader

    async def __aiter__(self) -> AsyncIterator[str]:
        data: list[str] = []
        async for batch in _closed(self._batches):
            for line in batch:
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


async def _one_each(lines: AsyncIterable[str]) -> AsyncIterator[list[str]]:
    async for line in lines:
        yield [line]


async def _line_batches(chunks: AsyncIterable[bytes]) -> AsyncIterator[list[str]]:
    """The complete lines of each read (UTF-8), their endings cut; a line's rest waits for the next read. A read
    that ends in `\r` keeps it back too: its `\n` may open the next read."""
    rest = b""
    async for chunk in chunks:
        lines = (rest + chunk).splitlines(keepends=True)  # bytes split on \n, \r\n and \r only
        rest = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        if lines:
            yield [line.decode("utf-8", "replace") for line in lines]
    if rest:
        yield [rest.decode("utf-8", "replace")]


async def _closed(batches: AsyncIterable[list[str]]) -> AsyncIterator[list[str]]:
    """The batches, then one blank line: an event still open at the end is dispatched."""
    async for batch in batches:
        yield batch
    yield [""]
