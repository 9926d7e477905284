# Duet: `make up` runs the stack, `make test` runs the tests; both set up first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup up test lint proto bench gpu-check gpu-wheels clean

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

# `make gpu-check`: python -m duet.gpu_check (duet/gpu_check/, docs/deploy.md "The GPU check"). On a CUDA machine,
# within 8 minutes: the environment (what the image lacks of the project's pins, installed from GPU_WHEELS or PyPI),
# the kernel tests compiled for real, the CUDA-graph tests, `duet up --device cuda` under the openai SDK, the
# engine and kernel benches, the extend tile sweep, tensor-parallel parity (2+ GPUs) and the 8B step times; every
# step's result as JSON under out/gpu-check/. Without CUDA each GPU step is recorded as skipped, with its reason,
# and the check passes (exit 0). A GPU image brings its own CUDA torch, so there the check runs on the machine's
# Python (no `setup`, which would pin the CPU torch); GPU_PY chooses another, GPU_CHECK_ARGS adds flags
# (e.g. --cpu-serve, --only serve, --model DIR).
GPU_PY     ?= $$(test -x $(PY) && echo $(PY) || echo python3)
GPU_WHEELS ?= .gpu-wheels
GPU_CHECK_ARGS ?=
gpu-check: $(if $(shell command -v nvidia-smi 2>/dev/null),,setup)
	$(GPU_PY) -m duet.gpu_check --out out/gpu-check $(if $(wildcard $(GPU_WHEELS)/*.whl),--wheels $(GPU_WHEELS)) $(GPU_CHECK_ARGS)

# The wheels a GPU image may lack (the gRPC runtime and protobuf the stubs need), for its Python 3.12, into
# $(GPU_WHEELS) (git-ignored, ~8 MiB): run where PyPI is reachable, carry the folder to the GPU machine.
gpu-wheels: setup
	$(PY) -m duet.gpu_check.wheels --dest $(GPU_WHEELS) --python-version 3.12

clean:
	rm -rf $(VENV) .pytest_cache
