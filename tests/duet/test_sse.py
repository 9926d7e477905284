"""duet/sse.py: the events an OpenAI-style SSE stream carries, read from its lines."""

from __future__ import annotations

import asyncio

import httpx

from duet.sse import SseReader


async def _lines(*lines: str):
    for line in lines:
        yield line


def read(*lines: str) -> tuple[list[str], bool]:
    async def go():
        reader = SseReader(_lines(*lines))
        return [data async for data in reader], reader.done

    return asyncio.run(go())


def test_one_event_per_data_line_up_to_done():
    events, done = read('data: {"a": 1}', "", 'data: {"a": 2}', "", "data: [DONE]", "", 'data: "after"', "")
    assert events == ['{"a": 1}', '{"a": 2}'] and done


def test_data_lines_of_one_event_are_joined_with_newlines():
    events, _ = read("data: {", 'data:  "a": 1', "data: }", "", "data:x", "data", "")
    assert events == ['{\n "a": 1\n}', "x\n"]  # one leading space is the separator; no space is fine too


def test_comments_other_fields_and_blank_lines_are_skipped():
    events, done = read(": keep-alive", "", "", "event: message", "id: 7", "retry: 10", 'data: {"a": 1}', "",
                        ": ping", "data: [DONE]", "")
    assert events == ['{"a": 1}'] and done


def test_a_stream_without_done_says_so_and_keeps_its_last_open_event():
    events, done = read('data: {"a": 1}', "", 'data: {"a": 2}')
    assert events == ['{"a": 1}', '{"a": 2}'] and not done
    assert read() == ([], False)


def test_done_without_a_final_blank_line_still_ends_the_stream():
    assert read("data: x", "", "data: [DONE]") == (["x"], True)


def test_crlf_lines_and_an_event_split_across_reads():
    """Through httpx's own line splitting, reads cut anywhere (inside `data:`, between \\r and \\n)."""
    raw = b'data: {"a": 1}\r\n\r\n: c\r\ndata: {"b":\r\ndata: 2}\r\n\r\ndata: [DONE]\r\n\r\n'

    async def go(cut: int):
        async def body():
            for i in range(0, len(raw), cut):
                yield raw[i:i + cut]

        resp = httpx.Response(200, content=body())
        reader = SseReader(resp.aiter_lines())
        return [data async for data in reader], reader.done

    for cut in (1, 2, 3, 5, 7, len(raw)):
        assert asyncio.run(go(cut)) == (['{"a": 1}', '{"b":\n2}'], True), cut


def test_from_bytes_reads_what_the_lines_read_whatever_the_cuts():
    """A raw body (`from_bytes`, the gateway's backends) cut anywhere, in UTF-8 characters too: the same events as
    httpx's line splitting gives, \\n, \\r\\n and lone \\r line ends alike."""
    for raw in (b'data: {"a": 1}\r\n\r\n: c\r\ndata: {"b":\r\ndata: 2}\r\n\r\ndata: "\xe6\x9d\xb1\xe4\xba\xac"\n\ndata: [DONE]\r\n\r\n',
                b'data: {"a": 1}\r\rdata: [DONE]\r\r', b'data: {"a": 1}\n\ndata: {"b": 2}'):
        async def go(cut: int, lines: bool, raw: bytes = raw):
            async def body():
                for i in range(0, len(raw), cut):
                    yield raw[i:i + cut]

            resp = httpx.Response(200, content=body())
            reader = SseReader(resp.aiter_lines()) if lines else SseReader.from_bytes(resp.aiter_bytes())
            return [data async for data in reader], reader.done

        expected = asyncio.run(go(len(raw), True))
        assert expected[0], raw
        for cut in (1, 2, 3, 5, 7, len(raw)):
            assert asyncio.run(go(cut, False)) == expected, (raw, cut)
