# vitscope: `make demo` runs the whole job on the embedded sample, `make test` checks it.
SHELL := /bin/bash
# pipefail: a failing benchmark piped into tee still fails the target
.SHELLFLAGS := -eo pipefail -c
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

.PHONY: install test test-fast lint format docs docs-serve demo sample train export serve bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints-x86_64-linux.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet $(CONSTRAINTS) -e '.[dev]'
	touch $@

# ruff, then the import contracts between the packages (pyproject.toml, [tool.importlinter])
lint: install
	$(BIN)/ruff check vit train serve tests benchmarks
	$(BIN)/ruff format --check vit train serve tests benchmarks
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff format vit train serve tests benchmarks
	$(BIN)/ruff check --fix vit train serve tests benchmarks

# The docs site (mkdocs.yml): every warning is an error, broken links and anchors included
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# Two workers (pytest-xdist), each running whole files, so that a file's server or model is built once:
# much of the suite waits on child processes, disks and sockets, not on the CPU. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install lint docs
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: install
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not browser"

# The main job on the embedded sample: data -> training -> ONNX -> server. Each step is a file
# target, so a second `make demo` reuses whatever is already up to date.
SAMPLE := data/digits
CKPT := $(RUN)/checkpoints/best.ckpt
ONNX := artifacts/sample.onnx

sample: $(SAMPLE)/.complete
$(SAMPLE)/.complete: | $(VENV)/.installed
	$(BIN)/vit-sample-data --out $(SAMPLE)

# make retrains only when the data or the config changed: then the old run is replaced (--overwrite)
train: $(CKPT)
$(CKPT): $(SAMPLE)/.complete configs/sample.yaml | $(VENV)/.installed
	$(BIN)/vit-train fit --config configs/sample.yaml --trainer.default_root_dir $(RUN) --overwrite true

# The exporter's own code is a prerequisite too: a new graph rewrite or metadata field reaches the
# model file after a `git pull`, without retraining.
EXPORTER := $(wildcard vit/*.py serve/export/*.py serve/runtime/*.py) train/checkpoint.py
export: $(ONNX)
$(ONNX): $(CKPT) $(EXPORTER)
	$(BIN)/vit-export $(CKPT) -o $(ONNX)

demo: install $(ONNX)
	$(BIN)/vit-serve $(ONNX) --host $(HOST) --port $(PORT)

serve: demo

# Every benchmark, one after another (they time the same 2 cores); outputs land in artifacts/bench/.
BENCH := artifacts/bench
bench: install $(ONNX)
	mkdir -p $(BENCH)
	$(PYTHON) benchmarks/model_vs_timm.py | tee $(BENCH)/model_vs_timm.md
	$(PYTHON) benchmarks/sample_accuracy.py | tee $(BENCH)/sample_accuracy.md
	$(PYTHON) benchmarks/train_overhead.py | tee $(BENCH)/train_overhead.md
	$(PYTHON) benchmarks/checkpoint_save.py | tee $(BENCH)/checkpoint_save.md
	$(PYTHON) benchmarks/export_bench.py | tee $(BENCH)/export_bench.md
	$(PYTHON) benchmarks/serve_bench.py $(ONNX) --duration 10 --soak 300 | tee $(BENCH)/serve_bench.md
	$(PYTHON) benchmarks/serve_bench.py --variant vit_tiny_patch16_224 --duration 10 | tee $(BENCH)/serve_bench_vit_tiny.md
	$(PYTHON) benchmarks/pointing_game.py $(ONNX) --n 300 --seed 0 | tee $(BENCH)/pointing_game.md
	$(PYTHON) benchmarks/gpu_train.py | tee $(BENCH)/gpu_train.md

clean:
	rm -rf runs artifacts site .pytest_cache
