"""`python -m duet.healthcheck`: the container image's HEALTHCHECK, for every role of the one image.

DUET_HEALTHCHECK names what to probe (default `http://127.0.0.1:8000/health`, the gateway):
`http://host:port/path` must answer 200; `grpc://host:port` must report SERVING on grpc.health.v1
(an engine worker: NOT_SERVING while it loads or drains). Exit status 0 healthy, 1 not.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_TARGET = "http://127.0.0.1:8000/health"


def check(target: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    if target.startswith("grpc://"):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        address = target.removeprefix("grpc://")
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{address}: {e.code().name}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as r:
            return r.status == 200, f"{target}: HTTP {r.status}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{target}: {e}"


def main() -> int:
    ok, detail = check(os.environ.get("DUET_HEALTHCHECK") or DEFAULT_TARGET)
    print(detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
