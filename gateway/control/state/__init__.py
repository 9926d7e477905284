"""Gateway state: one `StateStore` interface, two implementations.

- `gateway.control.state.memory.MemoryStore`: in-process, the default for a single gateway.
- `gateway.control.state.redis_store.RedisStore`: shared by every gateway replica through Redis.

What lives here: session affinity (key -> worker id, with a TTL the gateway refreshes by
calling `set_affinity` on every routed request), the routing config of each model (with a
change feed, `watch_routing`), the worker registry (entries expire unless heartbeated), and
an audit log of config changes, and stored conversation documents (the Responses API's
`store: true` responses, JSON with a TTL), and the traffic capture (its salt and its records,
gateway/control/capture.py). Routing configs are served from a local copy, so reading
them costs no round trip and survives a Redis outage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from gateway.routing.route_types import RoutingConfig


class StateUnavailable(Exception):
    """A write that must reach every gateway replica could not (shared state is down).
    Maps to HTTP 503 on the admin API."""


@runtime_checkable
class StateStore(Protocol):
    """The gateway's shared state. Reads never raise because the backend is down: they
    answer from the last known state. `healthy` says whether the backend is reachable and
    `redis_errors_total` counts failed backend calls (always 0 for the memory store)."""

    healthy: bool
    redis_errors_total: int

    async def get_affinity(self, key: str) -> str | None:
        """The worker this session/user key was last routed to, or None (unknown or expired)."""

    async def set_affinity(self, key: str, worker_id: str, ttl_s: float) -> None:
        """Map key -> worker for ttl_s seconds (called on every use, which refreshes the TTL)."""

    async def get_routing(self, model: str) -> RoutingConfig | None:
        """The model's routing config, or None for the built-in defaults."""

    async def put_routing(self, model: str, config: RoutingConfig, actor: str) -> None:
        """Replace the model's routing config, append an audit entry, notify every watcher.
        Raises StateUnavailable when the change cannot reach the other replicas."""

    def watch_routing(self) -> AsyncIterator[str]:
        """Async iterator of model names whose routing config changed (on any replica)."""

    async def register_worker(self, info: dict[str, Any], ttl_s: float) -> None:
        """Register or heartbeat a worker; `info` needs a "worker_id". Expires after ttl_s."""

    async def list_workers(self) -> list[dict[str, Any]]:
        """Registered workers whose heartbeat has not expired."""

    async def audit_log(self, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first: {"time", "actor", "model", "before", "after"} of config changes."""

    async def put_document(self, kind: str, doc_id: str, doc: dict[str, Any], ttl_s: float) -> None:
        """Keep a JSON document for ttl_s seconds (every replica reads it). Raises StateUnavailable when
        the shared backend cannot take it."""

    async def get_document(self, kind: str, doc_id: str) -> dict[str, Any] | None:
        """The document, or None (unknown or expired). Raises StateUnavailable when the shared backend
        is down (a document another replica wrote cannot be answered from a local copy)."""

    async def delete_document(self, kind: str, doc_id: str) -> bool:
        """Forget the document; False when there was none. Raises StateUnavailable when down."""

    async def capture_salt(self) -> str:
        """The deployment's random capture salt (gateway/control/capture.py), made on first use and the same
        for every replica; never exported. Raises StateUnavailable when the shared backend is down."""

    async def append_capture(self, lines: list[str], max_records: int) -> None:
        """Append captured trace records (JSON lines), keeping the newest `max_records`. Raises
        StateUnavailable when the shared backend cannot take them."""

    async def capture_lines(self) -> list[str]:
        """Every kept capture record, oldest first (every replica's). Raises StateUnavailable when down."""

    async def close(self) -> None:
        """Stop background work and release connections."""


__all__ = ["StateStore", "StateUnavailable"]
