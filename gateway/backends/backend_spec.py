"""External engine servers as workers: what the config says about one (`BackendSpec`) and its validation.

A backend is a server Duet did not start — vLLM (`vllm serve --enable-scale-out`), SGLang, or any
OpenAI-compatible completions server — standing in the gateway's fleet as a worker of one engine kind:

    backends:
      - engine: vllm                  # vllm | sglang | openai
        url: http://10.0.0.7:8000
        kind: paged                   # optional: vllm defaults to paged, sglang to prefix, openai to paged
        version: v1                   # optional deploy label (canary pools), default "external"
        kv_events:                    # optional: the engine's ZMQ KV-event publisher (exact cache view)
          endpoint: tcp://10.0.0.7:5557
          replay_endpoint: tcp://10.0.0.7:5558   # optional: missed batches are replayed from here
          topic: ""
          bind: false                 # true: the gateway binds `endpoint` and vLLM connects to it (vLLM binds
                                      # only a wildcard endpoint, tcp://*:PORT, and connects to any other)
        block_size: 128               # the engine's KV block size (vLLM's CPU default is 128)

`duet up --backend paged=http://HOST:PORT` builds the same entry (engine vllm). The worker id of a
backend is its URL; gateway/backends/http_backend.py is its client.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from duet.contract import ENGINE_KINDS, HASH_BLOCK_TOKENS, PAGED, PREFIX, Capability

ENGINES = ("vllm", "sglang", "openai")
DEFAULT_KIND = {"vllm": PAGED, "sglang": PREFIX, "openai": PAGED}
# what each engine does through the path Duet speaks to it (gateway/backends/backend_wire.py)
CAPABILITIES = {"vllm": (Capability.N, Capability.LOGPROBS, Capability.STRUCTURED_OUTPUT),
                "sglang": (Capability.N, Capability.STRUCTURED_OUTPUT), "openai": (Capability.N,)}
# tokens per KV block of each server (a backend's block_size overrides); a plain OpenAI server's: the gateway's
DEFAULT_BLOCK_SIZE = {"vllm": 128, "sglang": 1, "openai": HASH_BLOCK_TOKENS}


class BackendSpecError(ValueError):
    """A backends entry that cannot be used (the message names the field)."""


@dataclass(frozen=True)
class KvEventsSpec:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False  # the gateway binds `endpoint` (the engine's publisher connects to it)


@dataclass(frozen=True)
class BackendSpec:
    engine: str
    url: str
    kind: str
    version: str = "external"
    kv_events: KvEventsSpec | None = None
    block_size: int = 128

    @property
    def worker_id(self) -> str:
        return self.url


def _url(value, where: str) -> str:
    if not isinstance(value, str):
        raise BackendSpecError(f"{where}: 'url' must be a string like http://HOST:PORT, got {value!r}")
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
        raise BackendSpecError(f"{where}: 'url' must be http(s)://HOST:PORT, got {value!r}")
    return value.rstrip("/")


def _kv_events(raw, where: str) -> KvEventsSpec | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"endpoint": raw}
    if not isinstance(raw, dict) or not isinstance(raw.get("endpoint"), str):
        raise BackendSpecError(f"{where}: 'kv_events' needs an 'endpoint' like tcp://HOST:PORT, got {raw!r}")
    unknown = set(raw) - {"endpoint", "replay_endpoint", "topic", "bind"}
    if unknown:
        raise BackendSpecError(f"{where}: kv_events has unknown keys {sorted(unknown)}")
    for key in ("endpoint", "replay_endpoint"):
        value = raw.get(key)
        if value is not None and not (isinstance(value, str) and value.startswith(("tcp://", "ipc://"))):
            raise BackendSpecError(f"{where}: kv_events.{key} must be tcp://HOST:PORT or ipc://PATH, got {value!r}")
    if not isinstance(raw.get("bind", False), bool):
        raise BackendSpecError(f"{where}: kv_events.bind must be true or false, got {raw['bind']!r}")
    return KvEventsSpec(raw["endpoint"], raw.get("replay_endpoint"), str(raw.get("topic") or ""),
                        raw.get("bind", False))


def parse_backend(raw, index: int = 0) -> BackendSpec:
    where = f"backends[{index}]"
    if not isinstance(raw, dict):
        raise BackendSpecError(f"{where}: must be a mapping with 'engine' and 'url', got {raw!r}")
    unknown = set(raw) - {"engine", "url", "kind", "version", "kv_events", "block_size"}
    if unknown:
        raise BackendSpecError(f"{where}: unknown keys {sorted(unknown)}")
    engine = raw.get("engine", "vllm")
    if engine not in ENGINES:
        raise BackendSpecError(f"{where}: 'engine' must be one of {list(ENGINES)}, got {engine!r}")
    kind = raw.get("kind") or DEFAULT_KIND[engine]
    if kind not in ENGINE_KINDS:
        raise BackendSpecError(f"{where}: 'kind' must be 'paged' or 'prefix', got {kind!r}")
    block_size = raw.get("block_size", DEFAULT_BLOCK_SIZE[engine])
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise BackendSpecError(f"{where}: 'block_size' must be a positive integer, got {block_size!r}")
    return BackendSpec(engine, _url(raw.get("url"), where), kind, str(raw.get("version") or "external"),
                       _kv_events(raw.get("kv_events"), where), block_size)


def parse_backends(entries) -> tuple[BackendSpec, ...]:
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise BackendSpecError(f"'backends' must be a list, got {type(entries).__name__}")
    specs = tuple(parse_backend(e, i) for i, e in enumerate(entries))
    urls = [s.url for s in specs]
    dup = next((u for u in urls if urls.count(u) > 1), None)
    if dup:
        raise BackendSpecError(f"backends: {dup} is listed twice")
    return specs


def parse_backend_flag(flag: str) -> dict:
    """`KIND=URL` or `ENGINE:KIND=URL` (duet up --backend) as a config-file entry."""
    head, sep, url = flag.partition("=")
    if not sep or not url:
        raise BackendSpecError(f"--backend wants KIND=URL (e.g. paged=http://127.0.0.1:8100), got {flag!r}")
    engine, _, kind = head.rpartition(":")
    entry = {"engine": engine or "vllm", "url": url, "kind": kind}
    parse_backend(entry)  # fail now, with the flag's words, not when the gateway starts
    return entry
