"""Every error an engine raises on purpose, one tree for engine_core and both engine kinds.

    EngineError
    ├── InvalidRequestError     bad user input (HTTP 400 / gRPC INVALID_ARGUMENT); raised before any work for
    │                           the request starts
    ├── CapacityError           the request can never fit this worker (KV pages, batch budget)
    ├── EngineOverloadedError   too many requests in flight; retry elsewhere (RESOURCE_EXHAUSTED)
    ├── EngineDrainingError     the worker is draining or still loading its model (UNAVAILABLE)
    ├── RequestFailedError      the engine could not finish a request for a reason other than its input (INTERNAL)
    ├── WeightsError            a checkpoint's tensors do not match the model it claims to be
    ├── DeviceError             the device asked for is not there (`--device cuda` without CUDA)
    └── TensorParallelError     the model cannot be split over that many ranks, or the ranks could not start

The gRPC status each maps to is engine_core/servicer.py's `status_for`. Configuration errors (WeightsError,
DeviceError, TensorParallelError) are also ValueErrors, as InvalidRequestError is: the worker reports any
ValueError at start as a bad setting.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error an engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong; the message says what and how to fix it."""


class CapacityError(EngineError):
    """The request is valid but larger than this worker can ever hold."""


class EngineOverloadedError(EngineError):
    """Too many requests in flight; the caller may retry elsewhere (RESOURCE_EXHAUSTED)."""


class EngineDrainingError(EngineError):
    """The worker is shutting down or not loaded yet and takes no new requests (UNAVAILABLE)."""


class RequestFailedError(EngineError):
    """The engine could not finish a request for a reason other than its input (INTERNAL)."""


class WeightsError(EngineError, ValueError):
    """A weight file is missing a tensor, has an unexpected one, or a shape differs."""


class DeviceError(EngineError, ValueError):
    """The device asked for is not there (e.g. `--device cuda` on a machine without CUDA)."""


class TensorParallelError(EngineError, ValueError):
    """The model cannot be split this way, or the ranks could not start; the message names the numbers."""
