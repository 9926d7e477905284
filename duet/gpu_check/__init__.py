"""The GPU check (`make gpu-check`, `python -m duet.gpu_check`): every step that proves the GPU path, each
result as JSON under one folder (__main__.py says which steps, in what order, within what budget)."""
