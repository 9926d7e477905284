"""W3C trace context carried in gRPC metadata (no torch).

The gateway's gRPC client calls `inject_metadata()` inside its client span; an engine servicer calls
`context_from_grpc(servicer_context)` and starts its server span with that context as parent, so
one trace runs from the HTTP request through routing into the engine step.
"""

from __future__ import annotations

from opentelemetry import propagate
from opentelemetry.context import Context


def inject_metadata(context: Context | None = None) -> tuple[tuple[str, str], ...]:
    """The current (or given) trace context as gRPC metadata pairs (`traceparent`, `tracestate`)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items())


def extract_context(metadata) -> Context:
    """A parent context from gRPC metadata pairs (keys are lower-case in gRPC)."""
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def context_from_grpc(servicer_context) -> Context:
    """The caller's trace context for a grpc (or grpc.aio) servicer call."""
    return extract_context(servicer_context.invocation_metadata())
