"""A jax decode step writes its outputs into buffers it is given (donated): two sets taken in
turn, so a step's outputs always land in the same two places (one per executable copy on an
accelerator) and a GPU's CUDA graph never re-records the commands that write them."""

from __future__ import annotations

import jax
import pytest

from pagedjax import LLM, SamplingParams
from tests.support.hf_reference import hf_greedy
from tests.support.prompts import make_prompts


@pytest.mark.parametrize("speculative", [False, True])
def test_the_output_buffers_are_what_the_step_writes(tiny_model, speculative: bool) -> None:
    """_output_spec (what launch donates) equals the step's outputs, field by field, for every
    decode-shaped layout: jax gives each buffer to its output."""
    model_dir = tiny_model("llama")
    spec = ({"speculative_config": {"model": model_dir, "num_speculative_tokens": 2}}
            if speculative else {})
    llm = LLM(model_dir, backend="jax", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64, num_gpu_blocks_override=48, **spec)
    runner = llm.engine.runner
    layouts = [layout for layout in llm.engine.shapes.layouts()
               if layout.decode or layout.num_spec_tokens]
    assert any(layout.num_spec_tokens for layout in layouts) == speculative
    for layout in layouts:
        args, kwargs = runner._step_args(layout)
        out = jax.eval_shape(runner._step, *args, **kwargs)[3]
        want = runner._output_spec(layout)
        assert [(x.shape, x.dtype) for x in out] == [(x.shape, x.dtype) for x in want], layout
    llm.shutdown()


def test_decode_outputs_take_two_places(tiny_model) -> None:
    model_dir = tiny_model("llama")
    llm = LLM(model_dir, backend="jax", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64, num_gpu_blocks_override=48)
    runner, places = llm.engine.runner, {}
    launch = runner.launch

    def recording_launch(executable, model_input):
        out = launch(executable, model_input)
        if model_input.layout.decode:
            places.setdefault(model_input.layout, set()).add(out.tokens.unsafe_buffer_pointer())
        return out

    runner.launch = recording_launch
    prompts = make_prompts(llm.engine.model_config.vocab_size)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 12)
    assert places and all(len(p) == 2 for p in places.values())
    llm.shutdown()
