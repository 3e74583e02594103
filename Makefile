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

.PHONY: install test test-fast test-cluster test-serve-only lint format protos docs docs-serve doc-commands demo sample train export serve web bench report clean

# onnxruntime-web for `vit-export --web`, from npm at the version package-lock.json pins (never a CDN at run time)
WEB_PAGE := serve/export/web_page
ORT_WEB := $(WEB_PAGE)/node_modules/.installed

install: $(VENV)/.installed $(ORT_WEB)

$(ORT_WEB): $(WEB_PAGE)/package.json $(WEB_PAGE)/package-lock.json
	npm ci --prefix $(WEB_PAGE) --no-audit --no-fund --ignore-scripts --loglevel=error
	touch $@

# pip compiles the 21,000 modules of the dev venv one by one (96 s of a 180 s install in a new venv on the 2-core
# VM, 2026-12-03); compileall does it on every core (39 s). Left to the first imports instead, the three test workers
# each compiled the same modules at once (make test took 10 min 6 s to 10 min 57 s that way, 10 min 14 s to
# 10 min 41 s this way). The packages' own test folders are left out (3,800 modules nothing here imports: 35-39 s
# against 45-53 s). Its status is not checked: a few files are for newer Pythons (pip skips them as well).
$(VENV)/.installed: pyproject.toml constraints-x86_64-linux.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet --no-compile $(CONSTRAINTS) -e '.[dev]'
	$(PYTHON) -m compileall -qq -j 0 -x '/tests?/' $(VENV)/lib || true
	touch $@

# ruff, then the import contracts between the packages (pyproject.toml, [tool.importlinter])
lint: install
	$(BIN)/ruff check vit train serve tests benchmarks
	$(BIN)/ruff format --check vit train serve tests benchmarks
	$(BIN)/lint-imports
	if command -v node >/dev/null; then for f in $(WEB_PAGE)/*.js; do node --input-type=module --check < $$f; done; fi

format: install
	$(BIN)/ruff format vit train serve tests benchmarks
	$(BIN)/ruff check --fix vit train serve tests benchmarks

# The gRPC messages and Triton's model configuration (config.pbtxt) from their .proto. grpcio-tools 1.73 writes
# protobuf 6.31 code, which every protobuf from 6.31 on runs (tritonclient wants protobuf 6); the messages go into
# descriptor pools of their own, so that a process may also import tritonclient's copy of the `inference.*` messages.
PROTO_DIR := serve/server/grpc
CONFIG_PROTO_DIR := serve/server/repository
protos:
	test -x .venv-protoc/bin/python || $(PY) -m venv .venv-protoc
	.venv-protoc/bin/pip install --quiet grpcio-tools==1.73.1
	.venv-protoc/bin/python -m grpc_tools.protoc -I $(PROTO_DIR) --python_out=$(PROTO_DIR) $(PROTO_DIR)/grpc_predict_v2.proto
	sed -i 's/_descriptor_pool.Default()/_descriptor_pool.DescriptorPool()/' $(PROTO_DIR)/grpc_predict_v2_pb2.py
	.venv-protoc/bin/python -m grpc_tools.protoc -I $(CONFIG_PROTO_DIR) --python_out=$(CONFIG_PROTO_DIR) \
		$(CONFIG_PROTO_DIR)/model_config.proto
	sed -i 's/_descriptor_pool.Default()/_descriptor_pool.DescriptorPool()/' $(CONFIG_PROTO_DIR)/model_config_pb2.py

# The docs site (mkdocs.yml): every warning is an error, broken links and anchors included
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# Every command of README.md and the docs, run as written in a fresh clone of HEAD (tests/doc_commands.py; about an
# hour on 2 cores); `make test` checks only that each is run or listed. ARGS="--only README.md --keep" passes options;
# DOC_COMMANDS_VENV= has the clone build its own venv with `make install` instead of reusing this one.
DOC_COMMANDS_VENV ?= --venv $(VENV)
doc-commands: install
	$(PYTHON) -m tests.doc_commands $(DOC_COMMANDS_VENV) $(ARGS)

# Three workers (pytest-xdist) on two cores, each running whole files, so that a file's server or model is built
# once: much of the suite waits on child processes, disks and sockets, not on the CPU (on the 2-core VM two workers
# kept the cores 63% busy, three 78%, four lost more to contention than they gained; the same run varies by a
# minute or more with the host's load). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
# Files go to the workers in the order pytest collects them (tests/serve, tests/train, tests/vit), not xdist's
# default of the most tests first: that left the files of a few long tests (the DDP runs, the browser, the export
# options) for the end, where one worker ran them alone while the others had finished.
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The tests' hundred-odd Python processes (workers, servers, training runs, Ray workers) read the bytecode that the
# first import of each module writes (this project's own, and the serve-only venv's, which pip installs uncompiled);
# where PYTHONDONTWRITEBYTECODE is set (CI images often set it), each compiled them again.
WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=
test: install lint docs
	$(WRITE_BYTECODE) $(BIN)/pytest -q $(XDIST) -m "not cluster"

# Tiers, by marker: `slow` (servers, training runs; still run by `make test`), `browser` (Chromium), `gpu` (skipped
# without CUDA), `cluster` (a local Ray cluster: test-cluster, and CI after make test). test-fast leaves out the
# slow and browser tests. The cluster's tests mostly wait on Ray's processes: apart, they leave `make test` minutes
# shorter (BENCHMARKS.md, "The test suite": `python -m benchmarks.test_suite`).
test-fast: install
	$(WRITE_BYTECODE) $(BIN)/pytest -q $(XDIST) -m "not slow and not browser"

test-cluster: install
	$(WRITE_BYTECODE) $(BIN)/pytest -q $(XDIST) -m cluster

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
EXPORTER := $(wildcard vit/*.py serve/export/*.py serve/runtime/*.py) train/checkpoint_format.py train/errors.py
export: $(ONNX)
$(ONNX): $(CKPT) $(EXPORTER)
	$(BIN)/vit-export $(CKPT) -o $(ONNX)

# The runtime and server tests again in a venv with the [serve] extra alone, as production installs it: no torch.
# The tiny model they serve (and a repository holding it) is exported first in the full venv; tests that need
# torch, onnx or pyarrow skip there.
SERVE_ONLY := build/serve-only
test-serve-only: $(SERVE_ONLY)/venv/.installed $(SERVE_ONLY)/tiny.onnx
	$(WRITE_BYTECODE) VITSCOPE_TINY_ONNX=$(abspath $(SERVE_ONLY)/tiny.onnx) VITSCOPE_TINY_REPO=$(abspath $(SERVE_ONLY)/models) \
		$(SERVE_ONLY)/venv/bin/python -m pytest \
		-q $(XDIST) tests/serve

$(SERVE_ONLY)/venv/.installed: pyproject.toml | $(VENV)/.installed
	rm -rf $(SERVE_ONLY)/venv
	$(PYTHON) -m tests.venvs $(SERVE_ONLY)/venv serve
	touch $@

$(SERVE_ONLY)/tiny.onnx: tests/helpers.py $(EXPORTER) | $(VENV)/.installed
	rm -rf $(SERVE_ONLY)/models
	$(PYTHON) -m tests.helpers --tiny-onnx $@ --tiny-repo $(SERVE_ONLY)/models

demo: $(VENV)/.installed $(ONNX)  # not onnxruntime-web from npm: only the browser page needs it
	$(BIN)/vit-serve $(ONNX) --host $(HOST) --port $(PORT)

serve: demo

# The sample model in the browser: a static folder (vit-export --web), served by Python's static file server
WEB := artifacts/web
web: install $(WEB)/model.onnx
	@echo "open http://$(HOST):8000/ (Ctrl-C stops the server; any static host serves $(WEB)/)"
	$(PYTHON) -m http.server 8000 --bind $(HOST) --directory $(WEB)

$(WEB)/model.onnx: $(CKPT) $(EXPORTER) $(wildcard $(WEB_PAGE)/*.js $(WEB_PAGE)/*.html $(WEB_PAGE)/*.css) | $(ORT_WEB)
	$(BIN)/vit-export $(CKPT) --web $(WEB)

# The main benchmarks, one after another (they time the same 2 cores): each writes benchmarks/results/NAME.json
# and prints its tables, kept in artifacts/bench/; `make report` then rewrites the pages from the results.
# The server is paired with the tree of BASE (unpacked outside the clone) on the sample and on ViT-Ti/16.
BENCH := artifacts/bench
BASE ?= 9382f68
BASE_TREE := /tmp/vitscope-$(BASE)
AB_ARGS := --server-args="--preferred-batch-size 8"
bench: install $(ONNX)
	mkdir -p $(BENCH) $(BASE_TREE)
	git archive $(BASE) | tar -x -C $(BASE_TREE)
	$(PYTHON) -m benchmarks.model_vs_timm | tee $(BENCH)/model_vs_timm.md
	$(PYTHON) -m benchmarks.sample_accuracy | tee $(BENCH)/sample_accuracy.md
	$(PYTHON) -m benchmarks.train_overhead | tee $(BENCH)/train_overhead.md
	$(PYTHON) -m benchmarks.serve_ab $(BASE_TREE) . --model $(ONNX) $(AB_ARGS) | tee $(BENCH)/serve_ab.md
	$(PYTHON) -m benchmarks.serve_ab $(BASE_TREE) . --variant vit_tiny_patch16_224 --in-process $(AB_ARGS) | tee $(BENCH)/serve_ab_vit_tiny.md
	$(PYTHON) -m benchmarks.rollout_soak $(ONNX) --rollouts 200 | tee $(BENCH)/rollout_soak.md
	$(PYTHON) -m benchmarks.pointing_game $(ONNX) --n 300 --seed 0 | tee $(BENCH)/pointing_game.md

# The figures in docs/benchmarks/*.md, BENCHMARKS.md and README's results table, from benchmarks/results/*.json
# (tests/benchmarks/test_report.py fails when they differ from what this writes)
report: install
	$(PYTHON) -m benchmarks.report

clean:
	rm -rf runs artifacts site build/serve-only .pytest_cache $(WEB_PAGE)/node_modules
