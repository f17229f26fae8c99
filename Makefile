# lowcomm: set-up, demo, tests, lint.
#
# `make demo` and `make test` create a virtual environment in $(VENV) and install lowcomm into it
# (`make demo` the package alone, `make test` with its `dev` extra). PyTorch: when the
# environment has no torch yet, $(TORCH_SPEC) is installed first, pinned to 2.13.0 (the CPU build
# where pip is set up to find it, as on our CI machines). GPU users override it, e.g.
# `make demo TORCH_SPEC="torch==2.13.0"` with their pip index set to CUDA wheels, or reuse an
# existing install with `make demo VENV_ARGS=--system-site-packages`.

PYTHON     ?= python3
VENV       ?= .venv
VENV_ARGS  ?=
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
RUN_STAMP  := $(VENV)/.lowcomm-run
DEV_STAMP  := $(VENV)/.lowcomm-dev
DOCS_STAMP := $(VENV)/.lowcomm-docs
DEMO_ARGS  ?=

.PHONY: setup demo test docs docs-serve lint format clean

setup: $(DEV_STAMP)

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e .
	touch $(RUN_STAMP)

$(DEV_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -e ".[dev]"
	touch $(DEV_STAMP)

$(DOCS_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -e ".[docs]"
	touch $(DOCS_STAMP)

demo: $(RUN_STAMP)
	$(VENV)/bin/lowcomm train --algo co2 --workers 2 $(DEMO_ARGS)

test: $(DEV_STAMP)
	$(PY) -m pytest -q

# The documentation site into site/; strict: a broken link or anchor, a page missing from the
# navigation or an API reference that does not resolve fails the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/mypy

format: $(DEV_STAMP)
	$(VENV)/bin/ruff format src tests examples benchmarks
	$(VENV)/bin/ruff check --fix src tests examples benchmarks

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache .mypy_cache
