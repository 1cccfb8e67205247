"""Shared fixtures: tiny HF checkpoints built once per session (no downloads)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# On a CPU-only machine XLA's LLVM optimisations make up most of a compile and change no float
# result (no fast-math), and the suite compiles hundreds of step shapes: skip them; emit fusions
# the classic way (XLA:CPU's MLIR fusion emitters take twice the compile time for the same
# results: tests/kernels/test_pallas_attention.py's _FAST_COMPILE), one LLVM module a compile
# (split across threads it costs more CPU, and the suite's workers use both cores). Set before
# jax is imported; a GPU machine keeps its defaults.
if not Path("/dev/nvidiactl").exists():  # test_tensor_parallel.py's FAKE_DEVICES: the same
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                       "--xla_llvm_disable_expensive_passes=true "
                                       "--xla_cpu_use_fusion_emitters=false "
                                       "--xla_cpu_parallel_codegen_split_count=1")
# The session's own cache folder (compiled steps, step costs, the FFI library): engines of the
# same configuration share their compiled steps across tests, and nothing outside the run leaks
# in. Subprocesses the tests start inherit it.
os.environ.setdefault("PAGEDJAX_CACHE_DIR", tempfile.mkdtemp(prefix="pagedjax-tests-"))
# Engines compile each step shape when a step first needs it, not the whole set at startup: a
# test's few steps need a few of the dozens of shapes of its configuration. The tests of the
# closed set itself (compile-once, the engine's layouts, the server's metrics, adaptive
# speculation) turn startup compiles back on with the `compile_at_startup` fixture.
os.environ.setdefault("PAGEDJAX_COMPILE_AT_STARTUP", "0")
# Threads waiting in torch's OpenMP regions sleep instead of spinning (~0.2 s each time by
# default): with both cores busy (two workers, a server beside a client) spinning threads burned
# a third of the suite's CPU. Set before torch is imported; results are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Nor do engines freeze the garbage collector's heap at startup (a full collection first, ~0.2 s
# an engine over the suite's hundreds): tests/engine/test_gc_heap.py turns it back on.
os.environ.setdefault("PAGEDJAX_FREEZE_GC_HEAP", "0")

import pytest

from pagedjax.testing.checkpoints import (
    MULTIBYTE_TEXT,
    make_tiny_checkpoint,
    stdlib_corpus,
    train_tokenizer,
)
from tests.support import background


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("real_model") for item in items):
        config.stash[background.SMOLLM2_CONVERSION] = background.start_smollm2_conversion()


def pytest_unconfigure(config):
    conversion = config.stash.get(background.SMOLLM2_CONVERSION, None)
    background.stop([conversion] if conversion else [])


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (architecture, overrides): together they cover llama3 rope scaling, sliding windows,
# attention biases and tied embeddings.
TINY_MODELS = {
    "llama": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "mistral": ("mistral", {"sliding_window": 24}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "phi3": ("phi3", {"sliding_window": 24}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "qwen3_moe": ("qwen3_moe", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
    "granitemoe": ("granitemoe", {}),
    # A much smaller random model with the same tokenizer: a low-acceptance draft for "llama".
    "draft": ("llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}),
}


@pytest.fixture
def compile_at_startup(monkeypatch) -> None:
    """Engines made in this test build their whole closed set of step shapes at startup, as
    users' engines do."""
    monkeypatch.setenv("PAGEDJAX_COMPILE_AT_STARTUP", "1")


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(stdlib_corpus() + [MULTIBYTE_TEXT])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer):
    """tiny_model(name) -> checkpoint dir, built once per session."""
    cache: dict[str, str] = {}

    def make(name: str = "llama") -> str:
        if name not in cache:
            arch, overrides = TINY_MODELS[name]
            out = tmp_path_factory.mktemp(f"tiny-{name}")
            cache[name] = str(make_tiny_checkpoint(out, arch, tokenizer=tokenizer, **overrides))
            assert json.loads((out / "config.json").read_text())["vocab_size"] == len(tokenizer)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def eos_model(tiny_model, tmp_path_factory) -> str:
    """The "llama" tiny checkpoint with EOS made likely: its lm_head row points along the mean
    final hidden state, so EOS is the top token at a fair share of positions and beams end at
    various lengths."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    config = model.config
    ids = np.random.default_rng(1).integers(1, config.vocab_size, (8, 40))
    with torch.no_grad():
        hidden = model.model(torch.tensor(ids)).last_hidden_state.reshape(-1, config.hidden_size)
        direction = hidden.mean(0) / hidden.mean(0).norm()
        # The EOS logit is 3.5 on average over these positions (others: about N(0, 1.6)).
        model.lm_head.weight[config.eos_token_id] = direction * 3.5 / (hidden @ direction).mean()
    out = tmp_path_factory.mktemp("tiny-eos")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)
