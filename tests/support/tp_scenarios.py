"""Tensor-parallel scenarios run in a fresh process with 4 fake CPU devices (see
test_tensor_parallel.py): `python -m tests.support.tp_scenarios NAME JSON_ARGS` prints one JSON
line with the result."""

from __future__ import annotations

import json
import sys

GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def greedy(model: str, sizes: list[int], prompts: list[list[int]], draft: str | None = None,
           backend: str = "jax", keep_workers: bool = False,
           draft_tensor_parallel_size: int | None = None) -> dict:
    """Per tensor_parallel_size: each prompt's greedy tokens and per-token top-2 logprobs
    (keep_workers: also the torch worker processes, after shutdown)."""
    from pagedjax import LLM, SamplingParams

    spec = None if draft is None else {"model": draft, "num_speculative_tokens": 3}
    if draft_tensor_parallel_size is not None:
        spec["draft_tensor_parallel_size"] = draft_tensor_parallel_size
    out = {}
    for size in sizes:
        llm = LLM(model, backend=backend, tensor_parallel_size=size, max_model_len=128,
                  num_gpu_blocks_override=40, speculative_config=spec)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(**GREEDY), use_tqdm=False)
        out[size] = [{"tokens": r.outputs[0].token_ids,
                      "top2": [sorted((x.logprob for x in lp.values()), reverse=True)[:2]
                               for lp in r.outputs[0].logprobs]} for r in results]
        if draft is not None:
            out[f"{size}_drafts"] = llm.get_metrics()["spec_decode_num_draft_tokens"]
        workers = getattr(llm.engine.runner, "workers", None)
        llm.shutdown()
        if keep_workers and workers is not None:
            out[f"{size}_workers"] = workers.processes
    return out


def orbax(model: str, prompts: list[list[int]]) -> dict:
    """Greedy tokens from safetensors on one device, then from the Orbax checkpoint restored
    straight into TP=2 and TP=4 layouts."""
    import jax.numpy as jnp

    from pagedjax.backends.jax.params import save_orbax
    from pagedjax.config import ModelConfig

    fresh = greedy(model, [1], prompts)[1]
    save_orbax(model, ModelConfig.from_pretrained(model), jnp.float32)
    restored = greedy(model, [2, 4], prompts)
    return {"fresh": fresh, **restored}


def comm(model: str, size: int) -> dict:
    """All-reduce bytes of the sharded step's HLO beside TensorParallelPlan's count."""

    from pagedjax import LLM, SamplingParams
    from pagedjax.backends.jax.parallel import all_reduce_operands

    llm = LLM(model, tensor_parallel_size=size, max_model_len=128, num_gpu_blocks_override=40)
    engine, runner = llm.engine, llm.engine.runner
    engine.add_request("r", {"prompt_token_ids": list(range(1, 30))},
                       SamplingParams(temperature=0.0, max_tokens=2))
    engine._drain_inbox()  # the request reaches the scheduler (step() would do this first)
    engine.engine_core._apply_pending()
    model_input = engine.engine_core._prepare(engine.scheduler.schedule())
    hlo = runner.executable(runner.step_key(model_input)).as_text()  # the step it runs
    cfg, plan = engine.model_config, runner.target.plan
    return {"all_reduces": [[dtype, list(shape)] for dtype, shape in all_reduce_operands(hlo)],
            "num_tokens": model_input.layout.num_tokens,
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_logit_entries": engine.shapes.num_logit_entries,
            "planned_bytes_per_layer": plan.all_reduce_bytes_per_layer(
                model_input.layout.num_tokens, cfg.hidden_size, 4)}


def errors(model: str, tmp_dir: str) -> dict:
    """The errors for a size that does not divide the heads, and for more devices than there
    are (an 8-head copy of the model, so that 8 divides)."""
    from pagedjax import LLM
    from pagedjax.model_loader.tokenizer import load_tokenizer
    from pagedjax.testing.checkpoints import make_tiny_checkpoint

    eight_heads = make_tiny_checkpoint(tmp_dir, "llama", tokenizer=load_tokenizer(model),
                                       num_attention_heads=8, num_key_value_heads=8)
    messages = {}
    for size, path in ((3, model), (8, eight_heads)):
        try:
            LLM(str(path), tensor_parallel_size=size, max_model_len=128,
                num_gpu_blocks_override=40)
        except ValueError as error:
            messages[size] = str(error)
    return messages


if __name__ == "__main__":
    name, args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(globals()[name](**args)))
