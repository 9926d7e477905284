"""Engine benchmarks: see __main__.py (modes) and common.py (shared workloads, driver, baselines)."""
