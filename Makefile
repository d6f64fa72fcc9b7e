# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
SPEC   ?= examples/digits.yaml

.PHONY: run test lint typecheck imports unit bench clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/conveyor run $(SPEC)

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

imports: $(STAMP)
	$(BIN)/lint-imports

test: lint typecheck imports
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m loadtests.bench_codec
	$(BIN)/python -m loadtests.bench_bus

clean:
	rm -rf $(VENV) .conveyor .pytest_cache .mypy_cache .ruff_cache
