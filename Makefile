# Duet: `make up` runs the stack, `make test` runs the tests; both set up first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup up test lint proto bench clean

setup: $(STAMP)

# One pip command so the resolver sees every pin at once. Debian's chromium is
# the browser the dashboard test drives (Playwright downloads are not allowed).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && apt-get install -y -qq chromium redis-server >/dev/null || echo "warning: apt-get could not install chromium/redis-server"; \
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

clean:
	rm -rf $(VENV) .pytest_cache
