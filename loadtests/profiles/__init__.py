"""Profilers: the model runner's step (profile_step) and a served worker under load (profile_served)."""

# before any of these modules imports torch: the MKL path a worker runs on an AMD CPU (engine_core/mkl_on_amd.py)
from engine_core.mkl_on_amd import unlock_mkl_on_amd

unlock_mkl_on_amd()
