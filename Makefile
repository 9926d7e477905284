# Duet: `make up` runs the stack, `make test` runs the tests; both set up first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup up test lint proto bench gpu-check clean

setup: $(STAMP)

# One pip command so the resolver sees every pin at once. Debian's chromium is
# the browser the dashboard test drives (Playwright downloads are not allowed);
# Debian's prometheus ships promtool (the alert-rule tests) and the server the
# dashboard-queries test scrapes a stack with.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && apt-get install -y -qq chromium redis-server >/dev/null || echo "warning: apt-get could not install chromium/redis-server"; \
	fi
	@if ! command -v promtool >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && apt-get install -y -qq prometheus >/dev/null || echo "warning: apt-get could not install prometheus (promtool)"; \
	fi
	touch $(STAMP)

up: setup
	$(VENV)/bin/duet up

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

proto: setup
	$(PY) -m duet.rpc.regen

bench: setup
	$(PY) -m engine_core.kernels.bench --json

# On a CUDA machine: the kernel tests compiled for real (no TRITON_INTERPRET, tensors on the GPU; the tests
# that are about CPU tensors deselected), the kernel bench and the engine bench on the GPU, and with 2 or more
# GPUs the tensor-parallel parity tests over NCCL (TP=3 on the smollm2 shape needs 3).
# Without CUDA it says so and runs nothing (exit 0).
GPU_DESELECT := not test_cpu_report_has_reference_timings and not test_cpu_tensors_use_the_reference \
	and not test_forcing_triton_on_cpu
gpu-check: setup
	@if ! $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		echo "gpu-check: SKIPPED - no CUDA device is visible to torch (torch.cuda.is_available() is False); nothing was run"; \
	else \
		set -ex; \
		env -u TRITON_INTERPRET DUET_KERNEL_TEST_DEVICE=cuda $(PY) -m pytest -q tests/kernels -k "$(GPU_DESELECT)"; \
		env -u TRITON_INTERPRET $(PY) -m pytest -q tests/engine_core/test_cuda_graphs.py; \
		env -u TRITON_INTERPRET $(PY) -m engine_core.kernels.bench --json; \
		env -u TRITON_INTERPRET $(PY) -m loadtests.sim.calibrate.h200 --json; \
		env -u TRITON_INTERPRET $(PY) -m loadtests.engine_bench paged --quick --json --device cuda; \
		if [ "$$($(PY) -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then \
			env -u TRITON_INTERPRET DUET_TP_TEST_DEVICE=cuda $(PY) -m pytest -q tests/engine_core/test_tensor_parallel.py; \
		else echo "gpu-check: tensor-parallel parity SKIPPED - it needs 2 or more GPUs"; fi; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache
