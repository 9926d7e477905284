"""Errors the engine core raises, one tree for every engine.

    EngineError
    ├── InvalidRequestError   bad user input (maps to HTTP 400 / gRPC INVALID_ARGUMENT);
    │                         raised before any work for the request starts
    ├── CapacityError         the request can never fit this worker (KV pages, batch budget)
    └── WeightsError          a checkpoint's tensors do not match the model it claims to be
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine core raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong; the message says what and how to fix it."""


class CapacityError(EngineError):
    """The request is valid but larger than this worker can ever hold."""


class WeightsError(EngineError, ValueError):
    """A weight file is missing a tensor, has an unexpected one, or a shape differs."""
