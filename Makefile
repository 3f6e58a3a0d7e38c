SHELL := /bin/bash
# Two set-up commands: `make run` (train the tiny default on CPU) and `make test`.
# Both build .venv from the pinned requirements when it is missing or stale.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || echo $$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv run test test-fast lint format clean-venv

$(STAMP): requirements/base.txt requirements/sglang-cpu.txt requirements/sglang-nodeps.txt pyproject.toml
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements/base.txt 2>&1 | grep -v "is ignored" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m pip install --quiet -r requirements/sglang-cpu.txt 2>&1 | grep -v "is ignored" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m pip install --quiet --no-deps -r requirements/sglang-nodeps.txt 2>&1 | grep -v "is ignored" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -c "import torch, megatron.core, transformers, ray, yaml, rich, sglang; print('environment ok: torch', torch.__version__)"
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sao train --report $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check sao_megatron tests tools benchmarks
	$(VENV)/bin/ruff format --check sao_megatron tests tools benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix sao_megatron tests tools benchmarks
	$(VENV)/bin/ruff format sao_megatron tests tools benchmarks

clean-venv:
	rm -rf $(VENV)
