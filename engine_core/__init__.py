"""The shared engine runtime (torch): models, weight loader, KV pool, model runner, sampler, offline LLM.

    from engine_core import LLM, SamplingParams
"""

from engine_core.mkl_on_amd import unlock_mkl_on_amd

unlock_mkl_on_amd()  # before anything below imports torch: MKL's fast kernels on AMD CPUs (mkl_on_amd.py)

from engine_core.errors import CapacityError, EngineError, InvalidRequestError, WeightsError
from engine_core.llm import LLM, CompletionOutput, RequestOutput
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
