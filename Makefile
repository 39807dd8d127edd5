# Set-up and entry points. Each target creates the virtualenv on first use.
#   make test    run the test suite (CPU: Triton interpreter; CUDA: the GPU), without the
#                slow sm_90 compile-and-inspect checks
#   make test-all the whole suite, slow checks included (what CI runs)
#   make demo    python -m sailfish.demo
#   make bench   python -m sailfish.bench $(BENCH_ARGS)
#   make e2e     python -m sailfish.bench.e2e $(E2E_ARGS)   (end to end, Llama-3 shapes)
# VENV, PYTHON, PYTEST_ARGS, BENCH_ARGS, E2E_ARGS and CPU_TORCH can be overridden:
#   make test VENV=/tmp/venv PYTEST_ARGS="-k formats"

PYTHON ?= python3
VENV ?= .venv
# Without a working nvidia-smi, torch is installed first, pinned (a CPU build on the
# CPU machines this targets), so that `pip install -e .` does not pull CUDA wheels.
CPU_TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
BENCH_ARGS ?=
E2E_ARGS ?=

PY := $(VENV)/bin/python
HAS_CUDA := $(shell nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: test test-all demo bench e2e

test: $(VENV)/.installed
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(VENV)/.installed
	$(PY) -m sailfish.demo

bench: $(VENV)/.installed-bench
	$(PY) -m sailfish.bench $(BENCH_ARGS)

# transformers comes with the [test] extra (its [hf] part); [bench] adds the plots.
e2e: $(VENV)/.installed-bench
	$(PY) -m sailfish.bench.e2e $(E2E_ARGS)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(PY)
ifneq ($(HAS_CUDA),1)
	$(PY) -m pip install "$(CPU_TORCH)"
endif
	$(PY) -m pip install -e ".[test]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PY) -m pip install -e ".[test,bench]"
	touch $@
