# lowcomm: set-up, demo, tests, lint.
#
# `make demo` and `make test` create a virtual environment in $(VENV) and install lowcomm into it.
# PyTorch: when the environment has no torch yet, $(TORCH_SPEC) is installed first (default: the
# CPU build 2.13.0). GPU users override it, e.g. `make demo TORCH_SPEC="torch==2.13.0"` with their
# pip index configured for CUDA wheels, or reuse an existing install with
# `make demo VENV_ARGS=--system-site-packages`.

PYTHON     ?= python3
VENV       ?= .venv
VENV_ARGS  ?=
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.lowcomm-installed
DEMO_ARGS  ?=

.PHONY: setup demo test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowcomm train --algo co2 --workers 2 $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format src tests examples
	$(VENV)/bin/ruff check --fix src tests examples

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
