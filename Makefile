# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the test suite).
# The CPU set-up pins torch to the 2.13.0 CPU wheel; triton (test extra) runs the kernel tests under its CPU
# interpreter in their own pytest process (tests/kernels); flash-linear-attention is never installed here (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
TORCH_VERSION := 2.13.0
# the versions the suite last passed with (constraints.txt); `make test CONSTRAINTS=` in a fresh clone takes the newest
CONSTRAINTS ?= constraints.txt

.PHONY: setup demo test bench-quick

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@echo "setting up $(VENV) (once): torch $(TORCH_VERSION) CPU and the other packages, about 3 GB installed"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q torch==$(TORCH_VERSION)
	@$(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test,llamaindex,bench]"
	@touch $@

setup: $(VENV)/.installed

demo: setup
	@$(VENV)/bin/hypic-rag demo

test: setup
	$(PY) -m pytest -q -x -n 2 --dist loadfile --durations=15 tests --ignore=tests/kernels; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x --durations=5 tests/kernels

bench-quick: setup
	$(VENV)/bin/hypic-rag bench --quick
