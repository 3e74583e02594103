# vitscope: `make demo` runs the whole job on the embedded sample, `make test` checks it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
ARCH := $(shell uname -sm)
ifeq ($(ARCH),Linux x86_64)
CONSTRAINTS := -c constraints-x86_64-linux.txt
endif
RUN ?= runs/sample
HOST ?= 127.0.0.1
PORT ?= 7860

.PHONY: install test test-fast lint format demo sample train export serve bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints-x86_64-linux.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet $(CONSTRAINTS) -e '.[dev]'
	touch $@

lint: install
	$(BIN)/ruff check vit train serve tests benchmarks
	$(BIN)/ruff format --check vit train serve tests benchmarks

format: install
	$(BIN)/ruff format vit train serve tests benchmarks
	$(BIN)/ruff check --fix vit train serve tests benchmarks

test: install lint
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not slow and not browser"

bench: install
	$(PYTHON) benchmarks/model_vs_timm.py

clean:
	rm -rf runs artifacts .pytest_cache
