# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
SPEC   ?= examples/digits.yaml

.PHONY: run test lint typecheck imports unit bench lock clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)

# requirements-dev.lock pins every package `.[dev]` pulls in (torch is pinned in pyproject.toml).
# --no-compile: pip byte-compiles every file of every package (all of torch's) on one core, about
# 110 of the install's 220 s on two cores; Python compiles the modules a process imports on
# first use instead (measured: the first import of the services' packages took 0.9 s longer).
$(STAMP): pyproject.toml requirements-dev.lock | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c requirements-dev.lock -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/conveyor run $(SPEC)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

imports: $(STAMP)
	$(BIN)/lint-imports

# Unit and integration tests run in three worker processes (pytest-xdist): the integration
# tests mostly wait on the broker, timeouts and child processes, so on 2 cores three at a time
# take ~4.7 min where two took ~6 and one ~7.5. The end-to-end tests then run one at a time:
# each starts a whole stack of processes on the machine's cores, and what they check (data
# wait, step counts, recovery within a deadline) would be skewed by a second stack beside them.
test: lint typecheck imports
	$(BIN)/pytest -n 3 tests/unit tests/integration
	$(BIN)/pytest tests/e2e

bench: $(STAMP)
	$(BIN)/python -m loadtests.bench_codec
	$(BIN)/python -m loadtests.bench_bus

# Regenerate the lock files after a dependency change in pyproject.toml (needs PyPI):
# requirements.lock is what the service image installs (base dependencies, no extras),
# requirements-dev.lock what `make test` installs. torch is left out of both: pyproject.toml pins
# it exactly, and its build (CPU or CUDA, and so its dependencies) depends on the machine.
# The image lock is compiled within the dev lock's pins: the image runs what the tests ran.
LOCK_FLAGS := --quiet --strip-extras --no-emit-index-url --no-emit-find-links \
	--unsafe-package torch --unsafe-package conveyor
lock:
	tmp=$$(mktemp -d) && $(PYTHON) -m venv $$tmp \
	&& $$tmp/bin/python -m pip install --quiet pip-tools \
	&& CUSTOM_COMPILE_COMMAND="make lock" $$tmp/bin/pip-compile $(LOCK_FLAGS) --extra dev \
		--output-file requirements-dev.lock pyproject.toml \
	&& CUSTOM_COMPILE_COMMAND="make lock" $$tmp/bin/pip-compile $(LOCK_FLAGS) \
		--constraint requirements-dev.lock --output-file requirements.lock pyproject.toml \
	; status=$$?; rm -rf $$tmp; exit $$status

clean:
	rm -rf $(VENV) .conveyor .pytest_cache .mypy_cache .ruff_cache
