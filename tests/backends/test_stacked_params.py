"""The jax step's weights stacked over the layers (backends/jax/stacked_params.py,
PAGEDJAX_STACK_LAYER_PARAMS=1): the tree rebuilt exactly, layers of another shape (a mixture of
experts' dense layers) kept apart; an engine with them gives the tokens and logprobs of one
without, and its step takes one array per kind of weight whatever the depth; on a GPU the step
copies no weight (its temporaries are no larger than the unstacked step's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.backends.jax.stacked_params import stack_layers
from tests.support.prompts import make_prompts


def test_stacked_arrays_rebuild_the_tree() -> None:
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    layers = {f"layers_{i}": {"mlp": {"kernel": w(4, 8 if i < 3 else 6)}, "norm": w(4)}
              for i in range(4)}  # layer 3's MLP another shape
    tree = {"params": {"embed": w(10, 4), **layers, "head": w(4, 10)}}
    stacks, arrays = stack_layers(jax.tree.map(jnp.asarray, tree))
    shapes = sorted(tuple(a.shape) for a in arrays)
    assert shapes == [(3, 4, 8), (4, 4), (4, 6), (4, 10), (10, 4)]
    rebuilt = jax.jit(stacks.unstack)(arrays)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def _engine(model_dir: str, stacked: bool, monkeypatch) -> LLM:
    monkeypatch.setenv("PAGEDJAX_STACK_LAYER_PARAMS", "1" if stacked else "0")
    # "reference" attention: unpacked weights on a CPU (the packed C++ path never stacks)
    return LLM(model_dir, backend="jax", attention_impl="reference", max_model_len=128,
               num_gpu_blocks_override=64, max_num_batched_tokens=64)


def test_an_engine_with_stacked_weights_gives_the_same_outputs(tiny_model, monkeypatch) -> None:
    model_dir = tiny_model("llama")
    results, leaves = {}, {}
    for stacked in (False, True):
        llm = _engine(model_dir, stacked, monkeypatch)
        runner = llm.engine.runner
        assert (runner.target.stacks is not None) == stacked
        leaves[stacked] = len(jax.tree.leaves(runner.target.params))
        if not stacked:
            tree = runner.target.params["params"]
            num_layers = sum(name.startswith("layers_") for name in tree)
            per_layer = len(jax.tree.leaves(tree["layers_0"]))
            others = leaves[False] - num_layers * per_layer
        prompts = make_prompts(llm.engine.model_config.vocab_size)[:4]
        params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params * 2,
                            use_tqdm=False)
        results[stacked] = [o.outputs[0] for o in outs]
        llm.shutdown()
    assert num_layers >= 2 and leaves[True] == per_layer + others  # one array per kind
    for got, want in zip(results[True], results[False], strict=True):
        assert got.token_ids == want.token_ids
        if want.cumulative_logprob is not None:  # the greedy rows, with logprobs
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-5)


@pytest.mark.gpu
def test_on_a_gpu_the_stacked_step_copies_no_weight(tiny_model, monkeypatch) -> None:
    """XLA reads each layer's slice of a stacked weight in place (a GEMM fusion's operand): the
    compiled decode step's temporaries are no larger than the unstacked step's (on a CPU they
    are larger by the weights: its dots copy their operands' slices)."""
    model_dir = tiny_model("llama")
    temp = {}
    for stacked in (False, True):
        llm = _engine(model_dir, stacked, monkeypatch)
        runner = llm.engine.runner
        compiled = runner._lower(runner.shapes.decode_layout(4)).compile()
        temp[stacked] = compiled.memory_analysis().temp_size_in_bytes
        llm.shutdown()
    assert temp[True] <= temp[False] * 1.05 + 4096, temp
