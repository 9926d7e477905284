"""The shared engine runtime (torch): models, weight loader, KV pool, model runner, sampler, offline LLM.

    from engine_core import LLM, SamplingParams

Importing the package (or any module of it) builds and loads nothing: MKL's AMD shim (mkl_on_amd.py) is
loaded when a worker starts (`duet engine`, before anything imports torch) or on first use of `LLM` here,
and the native CPU kernels are built when a model first runs on them (kernels/cpu_native.py).
"""

from engine_core.errors import CapacityError, EngineError, InvalidRequestError, WeightsError
from engine_core.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CapacityError",
    "CompletionOutput",
    "EngineError",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
    "WeightsError",
]

_OFFLINE = ("LLM", "CompletionOutput", "RequestOutput")  # engine_core.llm's, which imports torch


def __getattr__(name: str):
    """The offline API on first use: unlock MKL's fast kernels first (once; too late, and it says so, if torch
    is already loaded), as a worker does at its start."""
    if name not in _OFFLINE:
        raise AttributeError(f"module 'engine_core' has no attribute {name!r}")
    from engine_core.mkl_on_amd import unlock_mkl_on_amd

    unlock_mkl_on_amd()
    from engine_core import llm

    return getattr(llm, name)
