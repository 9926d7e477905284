"""In-process StateStore: the default for a single gateway (no Redis).

Affinities and worker registrations expire on a monotonic clock; the affinity table is also
capped (oldest entries dropped first) so a flood of one-off session keys cannot grow it
without bound."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any

from gateway.control.state.codec import config_to_dict
from gateway.routing.route_types import RoutingConfig


class MemoryStore:
    def __init__(self, max_affinities: int = 1_000_000, audit_capacity: int = 1000,
                 max_documents: int = 100_000) -> None:
        self.healthy = True
        self.redis_errors_total = 0  # no backend: never fails
        self._max_affinities = max_affinities
        self._affinity: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (worker, expires)
        self._routing: dict[str, RoutingConfig] = {}
        self._workers: dict[str, tuple[dict[str, Any], float]] = {}
        self._audit: deque[dict[str, Any]] = deque(maxlen=audit_capacity)
        self._watchers: set[asyncio.Queue[str]] = set()
        self._max_documents = max_documents
        self._documents: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()  # -> (json, expires)
        self._capture_salt = secrets.token_hex(16)  # one gateway process is the deployment
        self._capture: deque[str] = deque()

    async def get_affinity(self, key: str) -> str | None:
        entry = self._affinity.get(key)
        if entry is None:
            return None
        if entry[1] <= time.monotonic():
            del self._affinity[key]
            return None
        return entry[0]

    async def set_affinity(self, key: str, worker_id: str, ttl_s: float) -> None:
        now = time.monotonic()
        self._affinity[key] = (worker_id, now + ttl_s)
        self._affinity.move_to_end(key)
        # entries are kept in refresh order: drop expired ones from the front, and the
        # oldest while over the cap
        while self._affinity:
            _, (_, expires) = next(iter(self._affinity.items()))
            if expires > now and len(self._affinity) <= self._max_affinities:
                break
            self._affinity.popitem(last=False)

    async def get_routing(self, model: str) -> RoutingConfig | None:
        return self._routing.get(model)

    async def put_routing(self, model: str, config: RoutingConfig, actor: str) -> None:
        config.validate()
        before = self._routing.get(model)
        self._routing[model] = config
        self._audit.appendleft({
            "time": time.time(),
            "actor": actor,
            "model": model,
            "before": config_to_dict(before) if before is not None else None,
            "after": config_to_dict(config),
        })
        for q in self._watchers:
            q.put_nowait(model)

    async def watch_routing(self) -> AsyncIterator[str]:
        q: asyncio.Queue[str] = asyncio.Queue()
        self._watchers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._watchers.discard(q)

    async def register_worker(self, info: dict[str, Any], ttl_s: float) -> None:
        if "worker_id" not in info:
            raise ValueError("worker info needs a 'worker_id'")
        self._workers[str(info["worker_id"])] = (dict(info), time.monotonic() + ttl_s)

    async def list_workers(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        for wid in [w for w, (_, exp) in self._workers.items() if exp <= now]:
            del self._workers[wid]
        return [dict(info) for info, _ in self._workers.values()]

    async def audit_log(self, limit: int = 100) -> list[dict[str, Any]]:
        return list(self._audit)[:limit]

    async def put_document(self, kind: str, doc_id: str, doc: dict[str, Any], ttl_s: float) -> None:
        self._documents[(kind, doc_id)] = (json.dumps(doc), time.monotonic() + ttl_s)
        self._documents.move_to_end((kind, doc_id))
        while len(self._documents) > self._max_documents:  # the oldest go first
            self._documents.popitem(last=False)

    async def get_document(self, kind: str, doc_id: str) -> dict[str, Any] | None:
        entry = self._documents.get((kind, doc_id))
        if entry is None or entry[1] <= time.monotonic():
            self._documents.pop((kind, doc_id), None)
            return None
        return json.loads(entry[0])  # a copy: callers may change what they get

    async def delete_document(self, kind: str, doc_id: str) -> bool:
        return self._documents.pop((kind, doc_id), None) is not None

    async def capture_salt(self) -> str:
        return self._capture_salt

    async def append_capture(self, lines: list[str], max_records: int) -> None:
        self._capture.extend(lines)
        while len(self._capture) > max_records:
            self._capture.popleft()

    async def capture_lines(self) -> list[str]:
        return list(self._capture)

    async def close(self) -> None:
        self._watchers.clear()
