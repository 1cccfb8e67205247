# Two commands on a fresh machine: `make run` (generate text) and `make test` (the test suite).
# CPU machines get torch's CPU build; on a GPU machine: make install TORCH_SPEC=torch JAX_SPEC="jax[cuda12]"
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
JAX_SPEC ?= jax
PROMPT ?= def main(argv):
BACKEND ?= jax

.PHONY: install run test lint bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(JAX_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The demo model pair ships in the package: plain decoding, then speculative decoding.
run: install
	$(VENV)/bin/pagedjax generate --backend $(BACKEND) --prompt "$(PROMPT)" --prompt "class Config(object):" --max-tokens 64
	$(VENV)/bin/pagedjax generate --backend $(BACKEND) --prompt "$(PROMPT)" --max-tokens 64 --speculate

lint: install
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest

bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/throughput.py --backend jax
	$(PY) benchmarks/throughput.py --backend torch
	$(PY) benchmarks/spec_decode.py
	$(PY) benchmarks/kernels.py
