# sglang-sm120 developer / CI entry points. Every target runs per SGLang stack: the SGLang release and the torch
# it pins, each in its own virtual environment (.venvs/<stack>) from requirements/<stack>/.
#
#   make test      from nothing, for every stack: venv (pinned) + build the kernels + ruff + pytest -m "not gpu"
#   make venv      (re)create the venvs whose requirements changed (stamp keyed on their hash)
#   make build     per stack: editable install of the Python parts, and the kernels built into the stack's venv
#                  (.venvs/<stack>/sm120-ext), outside the source tree, so no other environment's library is touched
#   make pytest    pytest -m "not gpu" in one stack, loading that build (SGL_SM120_EXT_LIBRARY)
#   make lint      ruff check
#   make test-gpu  pytest -m gpu on an existing environment (e.g. `make test-gpu PY=python`)
#   make clean     build outputs;  make distclean  also the venvs
#   STACKS=sglang-0.5.13.post1 make test   one stack only;  PIP_ATTEMPTS=1 make venv   no retry of a failed pip install
#   DROP_VENVS=1 make test   remove each stack's venv once its tests ran (CI: one venv on disk at a time, ~6 GB)

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

# The first stack is the default one (what `pip install -e ".[sglang]"` installs); lint runs in it.
STACKS      ?= sglang-0.5.23 sglang-0.5.13.post1
STACK       ?= $(firstword $(STACKS))
VENVS       := .venvs
VENV        := $(VENVS)/$(STACK)
VENV_PY     := $(VENV)/bin/python
BOOT_PY     ?= $(shell command -v python3.11 || command -v python3)
REQS         = requirements/$(STACK)/ci.txt requirements/$(STACK)/sglang-nodeps.txt
REQ_HASH     = $(shell cat $(REQS) | sha256sum | cut -c1-16)
STAMP        = $(VENV)/.stamp-$(REQ_HASH)
EXT_DIR      = $(VENV)/sm120-ext
PY          ?= $(VENV_PY)

export CUDA_HOME            ?= /usr/local/cuda
# CI has no GPU: build for the two arches the tests check (SM120 target, H200 test machines).
export TORCH_CUDA_ARCH_LIST ?= 9.0a;12.0a
export MAX_JOBS             ?= $(shell nproc)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# this machine's pip config names local index folders that may not exist; pip warns once per package
PIP_NOISE   := is ignored: it is neither a file nor a directory

# torch and its nvidia-* wheels come from the package index over the network; one dropped download (pip does not
# retry a read cut mid-wheel) failed a whole CI run. So a failed install is shown in full, then tried again, a few
# times; the last failure still fails the target. The log is kept in build/ for the run's record.
PIP_ATTEMPTS ?= 3
DROP_VENVS   ?= 0
# A venv with torch's CUDA wheels takes about 6 GB; pip needs room for the wheels it unpacks beside it. Checked
# before a venv is made, so a full disk is one clear line instead of three failed installs.
VENV_FREE_GB ?= 8
define pip_install
	@mkdir -p build; log=build/pip-$(STACK).log; \
	for attempt in $$(seq 1 $(PIP_ATTEMPTS)); do \
		echo "+ pip install $(1)  (attempt $$attempt of $(PIP_ATTEMPTS))"; \
		if $(VENV_PY) -m pip install --quiet $(1) > $$log 2>&1; then grep -v "$(PIP_NOISE)" $$log || true; break; fi; \
		grep -v "$(PIP_NOISE)" $$log || true; \
		if [ "$$attempt" -ge $(PIP_ATTEMPTS) ]; then echo ">>> pip install failed $(PIP_ATTEMPTS) times ($$log)"; exit 1; fi; \
		echo ">>> pip install failed (attempt $$attempt of $(PIP_ATTEMPTS), output above); trying again in 30 s"; sleep 30; \
	done
endef

.PHONY: venv build lint pytest test test-stack test-gpu clean distclean venv-one build-one

venv:
	@for s in $(STACKS); do $(MAKE) --no-print-directory venv-one STACK=$$s; done

venv-one: $(STAMP)

$(STAMP): $(REQS)
	@test -f requirements/$(STACK)/ci.txt || { echo ">>> unknown stack $(STACK) (requirements/$(STACK)/ missing)"; exit 1; }
	@echo ">>> creating $(VENV) with $(BOOT_PY) (pins hash $(REQ_HASH))"
	rm -rf $(VENV)
	mkdir -p $(VENVS)
	@free_gb=$$(( $$(df -Pk $(VENVS) | awk 'NR==2 {print $$4}') / 1048576 )); \
	if [ "$$free_gb" -lt $(VENV_FREE_GB) ]; then \
		echo ">>> only $$free_gb GB free under $(VENVS) (df below); a venv for $(STACK) needs about $(VENV_FREE_GB) GB"; \
		df -h $(VENVS); exit 1; fi
	$(BOOT_PY) -m venv $(VENV)
	$(call pip_install,-r requirements/$(STACK)/ci.txt)
	$(call pip_install,--no-deps -r requirements/$(STACK)/sglang-nodeps.txt)
	touch $@

build:
	@for s in $(STACKS); do $(MAKE) --no-print-directory build-one STACK=$$s; done

# The Python parts as an editable install (the tests see this checkout, the entry point is registered), the
# kernels built into the venv: a library in the source tree would be the one a user's own `pip install -e .`
# loads. The library's name still carries the torch it was built for (sgl_kernel_sm120/_abi.py).
build-one:
	@echo ">>> [$(STACK)] building sglang-sm120 (TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST), CUDA_HOME=$(CUDA_HOME))"
	@mkdir -p build
	@SGL_SM120_SKIP_EXT=1 $(PY) -m pip install -v --no-build-isolation --no-deps -e . > build/pip-install-$(STACK).log 2>&1 \
		|| { cat build/pip-install-$(STACK).log; echo ">>> [$(STACK)] install FAILED (log: build/pip-install-$(STACK).log)"; exit 1; }
	@$(PY) setup.py build_ext --build-lib $(EXT_DIR) --build-temp $(VENV)/sm120-build-temp > build/build-ext-$(STACK).log 2>&1 \
		|| { cat build/build-ext-$(STACK).log; echo ">>> [$(STACK)] build FAILED (log: build/build-ext-$(STACK).log)"; exit 1; }
	@grep "sglang-sm120: building" build/build-ext-$(STACK).log | tail -n 1
	@ls $(EXT_DIR)/sgl_kernel_sm120/_C_torch*.so | sed 's/^/>>> built /'

lint:
	$(PY) -m ruff check .

pytest:
	@echo ">>> [$(STACK)] pytest -m 'not gpu'"
	SGL_SM120_EXT_LIBRARY=$$(ls $(abspath $(EXT_DIR))/sgl_kernel_sm120/_C_torch*.so) $(PY) -m pytest -m "not gpu"

# Lint runs in the first stack, before its venv may be dropped.
test-stack: venv-one
	$(MAKE) --no-print-directory build-one pytest STACK=$(STACK) PY=$(VENV_PY)
	@if [ "$(STACK)" = "$(firstword $(STACKS))" ]; then $(MAKE) --no-print-directory lint STACK=$(STACK); fi
	@if [ "$(DROP_VENVS)" = 1 ]; then echo ">>> removing $(VENV) (DROP_VENVS=1)"; rm -rf $(VENV); fi

test:
	@for s in $(STACKS); do $(MAKE) --no-print-directory test-stack STACK=$$s; done

test-gpu:
	$(PY) -m pytest -m gpu

clean:
	rm -rf build *.egg-info python/*.egg-info sgl_kernel_sm120/_C*.so sgl_kernel_sm120/_C*.build.json .pytest_cache .ruff_cache
	find . -path ./$(VENVS) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENVS) .venv
