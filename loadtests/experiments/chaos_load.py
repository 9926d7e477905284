"""The traffic of `duet bench chaos`: mixed OpenAI requests and a stream of hostile bodies, each
outcome classified the way a client sees it.

    ok            a complete answer (JSON with a finish reason; a stream with a finish reason and [DONE])
    clean_error   an OpenAI error object: an HTTP error with one, or a stream ending in an error event + [DONE]
    cut           the connection broke while the gateway serving it was being killed (the client saw the
                  failure; no gateway can answer after SIGKILL)
    lost          anything else without a complete answer or an error: a truncated stream, a 5xx that
                  is not an error object, a transport failure no fault explains
    hung          no end within `hung_after_s`

A request whose connection is refused never reached a gateway: like a load balancer, the client sends
it to the other gateway (up to every gateway once) and it is classified by that attempt.

`flood` is the drill's long-prompt phase (issue 21): many long prompts at once, each either answered
or refused at once with 429 + Retry-After (admission control); anything else is lost.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

OUTCOMES = ("ok", "clean_error", "cut", "lost", "hung")


@dataclass
class Tally:
    counts: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    examples: list = field(default_factory=list)  # the first few lost/hung, for the report
    fuzz: dict = field(default_factory=lambda: {"sent": 0, "error_object_4xx": 0, "bad": 0})

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome in ("lost", "hung") and len(self.examples) < 10:
            self.examples.append(f"{outcome}: {detail}"[:300])


class Gateways:
    """The gateways' URLs and when each was last killed (so a broken connection can be explained)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.killed_at: dict[str, float] = {}

    def explains_cut(self, url: str, started: float) -> bool:
        t = self.killed_at.get(url)
        return t is not None and started <= t + 0.5


def _body(rng: random.Random, model: str) -> tuple[str, dict]:
    stream = rng.random() < 0.6
    max_tokens = rng.randint(4, 48)
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(rng.randint(3, 60)))
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": words}],
                                        "max_tokens": max_tokens, "stream": stream, "temperature": 0}
    return "/v1/completions", {"model": model, "prompt": words, "max_tokens": max_tokens, "stream": stream,
                               "ignore_eos": rng.random() < 0.5}


async def _stream_outcome(resp: httpx.Response) -> tuple[str, str]:
    finished = errored = done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            errored = True
        elif any(c.get("finish_reason") for c in event.get("choices", ())):
            finished = True
    if done and errored:
        return "clean_error", ""
    if done and finished:
        return "ok", ""
    return "lost", f"stream ended done={done} finished={finished} errored={errored}"


async def one_request(client: httpx.AsyncClient, gws: Gateways, path: str, body: dict, rng: random.Random,
                      hung_after_s: float) -> tuple[str, str]:
    order = rng.sample(gws.urls, len(gws.urls))
    for url in order:
        started = time.monotonic()
        try:
            async with asyncio.timeout(hung_after_s):
                return await _attempt(client, url + path, body)
        except TimeoutError:
            return "hung", f"{path} on {url} after {hung_after_s:.0f} s"
        except httpx.ConnectError:
            continue  # never reached this gateway: try the next, as a load balancer would
        except (httpx.TransportError, json.JSONDecodeError) as e:
            if gws.explains_cut(url, started):
                return "cut", ""
            return "lost", f"{path} on {url}: {type(e).__name__}: {e}"
    return "clean_error", ""  # no gateway accepted the connection: the client knows it failed at once


async def _attempt(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                ok = isinstance(json.loads(raw)["error"]["message"], str)
            except (ValueError, KeyError, TypeError):
                ok = False
            return ("clean_error", "") if ok else ("lost", f"{resp.status_code} without an error object: {raw[:120]!r}")
        if body.get("stream"):
            return await _stream_outcome(resp)
        payload = json.loads(await resp.aread())
        if payload.get("choices") and all(c.get("finish_reason") for c in payload["choices"]):
            return "ok", ""
        return "lost", f"200 without a finish reason: {str(payload)[:120]}"


async def client_loop(gws: Gateways, model: str, tally: Tally, stop: asyncio.Event, seed: int,
                      hung_after_s: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(hung_after_s, connect=2.0)) as client:
        while not stop.is_set():
            path, body = _body(rng, model)
            outcome, detail = await one_request(client, gws, path, body, rng, hung_after_s)
            tally.add(outcome, detail)


def hostile_bodies(model: str) -> list[bytes]:
    """What the edge must answer with a 4xx OpenAI error object, never a 5xx or a dropped connection."""
    m = json.dumps(model)
    return [
        b'{"model": %s, "prompt": "x", "a": %s1%s}' % (m.encode(), b"[" * 2000, b"]" * 2000),
        b'{"model": %s, "prompt": "a\\ud800b", "max_tokens": 2}' % m.encode(),
        b'{"model": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": %s, "prompt": "x", "stop_token_ids": [1000000000000]}' % m.encode(),
        b'{"model": %s, "prompt": "x", "max_tokens": %s}' % (m.encode(), b"9" * 5000),
        b'{"model": %s, "prompt": "x", "temperature": 1e400}' % m.encode(),
        b'{"model": %s, "prompt": "x", "temperature": NaN}' % m.encode(),
        b'{"model": %s, "messages": [{"role": "user", "content": {"x": 1}}]}' % m.encode(),
        b'{"model": %s, "prompt": [1, 2, -3]}' % m.encode(),
        b'{"model": %s, "prompt": "x", "n": 0}' % m.encode(),
        b'{"model": %s, "prompt": "x"' % m.encode(),
        b"\xff\xfe\x00garbage",
        b"[]",
        b"",
    ]


async def fuzz_loop(gws: Gateways, model: str, tally: Tally, stop: asyncio.Event, seed: int,
                    interval_s: float = 0.2) -> None:
    rng = random.Random(seed)
    bodies = hostile_bodies(model)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as client:
        while not stop.is_set():
            body = rng.choice(bodies)
            path = rng.choice(("/v1/completions", "/v1/chat/completions"))
            for url in rng.sample(gws.urls, len(gws.urls)):
                try:
                    r = await client.post(url + path, content=body, headers={"content-type": "application/json"})
                except httpx.TransportError:
                    continue  # a gateway being killed: the other one gets it
                tally.fuzz["sent"] += 1
                try:
                    good = 400 <= r.status_code < 500 and isinstance(r.json()["error"]["message"], str)
                except (ValueError, KeyError, TypeError):
                    good = False
                if good:
                    tally.fuzz["error_object_4xx"] += 1
                else:
                    tally.fuzz["bad"] += 1
                    tally.add("lost", f"fuzz body {body[:60]!r} -> {r.status_code} {r.text[:100]}")
                break
            await asyncio.sleep(interval_s)


async def _flood_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, float, str]:
    """(outcome, seconds to the first token or to the refusal, detail); outcome ok | refused | lost."""
    t0 = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code == 429:
                raw = await resp.aread()
                try:
                    shaped = isinstance(json.loads(raw)["error"]["message"], str)
                except (ValueError, KeyError, TypeError):
                    shaped = False
                if shaped and resp.headers.get("retry-after", "").isdigit():
                    return "refused", time.monotonic() - t0, ""
                return "lost", 0.0, f"429 without Retry-After or an error object: {raw[:120]!r}"
            if resp.status_code != 200:
                return "lost", 0.0, f"{resp.status_code}: {(await resp.aread())[:200]!r}"
            first = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "lost", 0.0, f"error event: {event['error'].get('message', '')[:160]}"
                if first is None and any(c.get("text") for c in event.get("choices", ())):
                    first = time.monotonic() - t0
            return ("ok", first, "") if first is not None else ("lost", 0.0, "no tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return "lost", 0.0, f"{type(e).__name__}: {e}"


async def flood(gws: Gateways, model: str, requests: int, prompt_tokens: int, max_tokens: int, vocab_size: int,
                seed: int, timeout_s: float) -> dict:
    """`requests` long prompts (distinct token ids: no cache hit shortens them) sent at once over the gateways."""
    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": [rng.randrange(3, vocab_size) for _ in range(prompt_tokens)],
               "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
              for _ in range(requests)]
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=2.0)) as client:
        results = await asyncio.gather(*(_flood_one(client, gws.urls[i % len(gws.urls)], b)
                                         for i, b in enumerate(bodies)))
    ok = [t for o, t, _ in results if o == "ok"]
    refused = [t for o, t, _ in results if o == "refused"]
    return {"sent": requests, "ok": len(ok), "refused": len(refused), "lost": requests - len(ok) - len(refused),
            "prompt_tokens": prompt_tokens, "max_ttft_s": round(max(ok), 2) if ok else None,
            "max_refusal_s": round(max(refused), 2) if refused else None,
            "duration_s": round(time.monotonic() - t0, 2), "examples": [d for o, _, d in results if o == "lost"][:5]}
