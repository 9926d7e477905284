"""Engine benchmarks: see __main__.py (modes) and common.py (shared workloads, driver, baselines)."""

# before any of these modules imports torch: the MKL path a worker runs on an AMD CPU (engine_core/mkl_on_amd.py)
from engine_core.mkl_on_amd import unlock_mkl_on_amd

unlock_mkl_on_amd()
