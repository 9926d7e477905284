"""The gateway's in-flight cap: `max_pending_requests` requests inside the gateway at once, counted from
`start` until their run finishes; the next is refused at once (429 QueueFull) instead of queueing.

(Admission control proper, refusing a request the engines could not start in time, is
gateway/serving/admission.py; per-key limits are gateway/control/limits.py.)
"""

from __future__ import annotations

from prometheus_client import Gauge

from gateway.errors import QueueFull


class PendingRequests:
    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.count = 0
        self._gauge = gauge  # duet_gateway_pending_requests

    def claim(self) -> None:
        """Count one more request inside the gateway, or refuse it (429) when `limit` are in flight."""
        if self.count >= self.limit:
            raise QueueFull(f"the gateway has {self.count} requests in flight "
                            f"(max_pending_requests={self.limit}); retry later")
        self.count += 1
        self._gauge.set(self.count)

    def release(self) -> None:
        self.count -= 1
        self._gauge.set(self.count)
