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

# The smoke subset on a second PyTorch (the newest pip installs here, 2.14.1): the numerical
# equivalence and resume tests, in an environment of its own (.venv-torch) with lowcomm and its
# `test` extra; .ci/run runs it.
SMOKE_VENV  ?= .venv-torch
SMOKE_TORCH ?= torch==2.14.1
SMOKE_TESTS ?= tests/test_equivalence.py tests/test_resume.py
SMOKE_EXTRA ?= test
SMOKE_PY    := $(SMOKE_VENV)/bin/python

.PHONY: setup demo test smoke-torch docs docs-serve lint format clean

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

# The suite: every test but those marked serial two at a time (one module to a process), then
# the serial ones alone (tests/conftest.py); both parts run, and either failing fails the target.
test: $(DEV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial"; a=$$?; \
	$(PY) -m pytest -q -p no:xdist -m serial; b=$$?; \
	test $$a -eq 0 && test $$b -eq 0

smoke-torch:
	test -x $(SMOKE_PY) || $(PYTHON) -m venv $(SMOKE_VENV)
	$(SMOKE_PY) -m pip install "$(SMOKE_TORCH)"
	$(SMOKE_PY) -m pip install -e ".[$(SMOKE_EXTRA)]"
	$(SMOKE_PY) -c "import torch; print('smoke tests on torch', torch.__version__)"
	$(SMOKE_PY) -m pytest -q -p no:cacheprovider $(SMOKE_TESTS)

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
	rm -rf $(VENV) $(SMOKE_VENV) runs site .pytest_cache .ruff_cache .mypy_cache
