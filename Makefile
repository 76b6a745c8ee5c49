# sglang-sm120 developer / CI entry points.
#
#   make test      from nothing: .venv (pinned) + build _C + ruff + pytest -m "not gpu"
#   make venv      only (re)create .venv when requirements/*.txt changed (stamp keyed on their hash)
#   make build     pip install --no-build-isolation --no-deps -e .  (builds sgl_kernel_sm120._C)
#   make lint      ruff check
#   make test-gpu  pytest -m gpu on an existing environment (e.g. `make build test-gpu PY=python`)
#   make clean     build outputs;  make distclean  also .venv

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

VENV        := .venv
VENV_PY     := $(VENV)/bin/python
BOOT_PY     ?= $(shell command -v python3.11 || command -v python3)
REQS        := requirements/ci.txt requirements/sglang-nodeps.txt
REQ_HASH    := $(shell cat $(REQS) | sha256sum | cut -c1-16)
STAMP       := $(VENV)/.stamp-$(REQ_HASH)
# Interpreter for build/lint/pytest targets: the venv when it exists, else override with PY=...
PY          ?= $(if $(wildcard $(VENV_PY)),$(VENV_PY),python3)

export CUDA_HOME            ?= /usr/local/cuda
# CI has no GPU: build for the two arches the tests check (SM120 target, H200 test machines).
export TORCH_CUDA_ARCH_LIST ?= 9.0a;12.0a
export MAX_JOBS             ?= $(shell nproc)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# this machine's pip config names local index folders that may not exist; pip warns once per package
PIP_NOISE   := is ignored: it is neither a file nor a directory

.PHONY: venv build lint pytest test test-gpu clean distclean

venv: $(STAMP)

$(STAMP):
	@echo ">>> creating $(VENV) with $(BOOT_PY) (pins hash $(REQ_HASH))"
	rm -rf $(VENV)
	$(BOOT_PY) -m venv $(VENV)
	$(VENV_PY) -m pip install --quiet -r requirements/ci.txt 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	$(VENV_PY) -m pip install --quiet --no-deps -r requirements/sglang-nodeps.txt 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	touch $@

build:
	@echo ">>> building sglang-sm120 (TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST), CUDA_HOME=$(CUDA_HOME))"
	@mkdir -p build
	@rm -f sgl_kernel_sm120/_C*.so
	@$(PY) -m pip install -v --no-build-isolation --no-deps -e . > build/pip-install.log 2>&1 \
		|| { cat build/pip-install.log; echo ">>> build FAILED (log: build/pip-install.log)"; exit 1; }
	@grep -B1 -A3 "were NOT built" build/pip-install.log || true
	@tail -n 1 build/pip-install.log
	@ls sgl_kernel_sm120/_C*.so 2>/dev/null | sed 's/^/>>> built /' || true

lint:
	$(PY) -m ruff check .

pytest:
	$(PY) -m pytest -m "not gpu"

test: venv
	$(MAKE) --no-print-directory build lint pytest PY=$(VENV_PY)

test-gpu:
	$(PY) -m pytest -m gpu

clean:
	rm -rf build *.egg-info python/*.egg-info sgl_kernel_sm120/_C*.so .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
