"""The JAX backend's own paths: forks, seeds, logprobs, the Pallas kernel end to end, the pool's
sizing, padding to min_decode_rows, branch-free decode steps and executable copies (HF greedy
parity over every architecture: tests/e2e/test_hf_parity.py)."""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams
from tests.support.hf_reference import hf_greedy
from tests.support.prompts import make_prompts

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, backend="jax", max_model_len=256, **kwargs)


def test_parallel_sampling_forks_share_the_prompt(tiny_model) -> None:
    """n=3 greedy completions fork one prefill (copy-on-write) and all equal HF's greedy."""
    model_dir = tiny_model("llama")
    llm = make_llm(model_dir, num_gpu_blocks_override=64)
    prompts = make_prompts(llm.engine.model_config.vocab_size)[:3]  # lengths 1, 15, 16
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, want in zip(outputs, expected):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in out.outputs)
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    assert metrics["prompt_tokens_total"] == sum(map(len, prompts))


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model) -> None:
    llm = make_llm(tiny_model("llama"), num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=1234,
                            max_tokens=16, ignore_eos=True, n=2)
    alone = llm.generate("def main():", params, use_tqdm=False)[0]
    crowd = llm.generate(["x = 1", "def main():", "import os"],
                         [SamplingParams(temperature=1.0, max_tokens=8), params,
                          SamplingParams(temperature=0.5, max_tokens=12)], use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # siblings differ


def test_logprobs_are_the_raw_model_distribution(tiny_model) -> None:
    llm = make_llm(tiny_model("llama"), num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    completion = llm.generate("print(", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == 6
    total = 0.0
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert len(entry) == 3 and token in entry  # greedy: the sampled token is the top one
        assert max(lp.logprob for lp in entry.values()) == entry[token].logprob
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3] and entry[token].rank == 1
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "pallas_fused"])
def test_pallas_kernel_end_to_end(tiny_model, impl) -> None:
    """attention_impl="pallas" (interpret mode on CPU) gives the same greedy tokens as HF; so
    does "pallas_fused", whose decode steps write the KV and attend in one kernel per layer."""
    model_dir = tiny_model("mistral")  # sliding window through the kernel too
    llm = make_llm(model_dir, attention_impl=impl, num_gpu_blocks_override=64,
                   max_num_batched_tokens=64)
    assert llm.engine.runner.attention_impl == impl
    decode_fn = llm.engine.runner.target.module.decode_fn
    assert (decode_fn is not None) == (impl == "pallas_fused")
    prompts = [p for p in make_prompts(llm.engine.model_config.vocab_size) if len(p) in (1, 17, 53)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 6)


def test_pool_sized_by_a_trial_step(tiny_model, monkeypatch) -> None:
    """The accelerator path of sizing the KV pool (a trial of the heaviest step on throwaway
    caches, then the device's memory statistics) builds an engine that serves; a CPU device has
    no statistics, so the pool falls back to the host budget."""
    from pagedjax.backends.jax import runner

    monkeypatch.setattr(runner, "_measures_memory", lambda device: True)
    model_dir = tiny_model("llama")
    llm = make_llm(model_dir, max_num_batched_tokens=64)
    assert llm.engine.runner.num_kv_blocks > 0
    prompts = [p for p in make_prompts(llm.engine.model_config.vocab_size) if len(p) in (1, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 4)


def test_decode_steps_padded_to_min_decode_rows(tiny_model, monkeypatch) -> None:
    """With the GPU's smallest sequence bucket (min_decode_rows 16, forced here) a decode step
    of 2 sequences runs the 16-row shape and the tokens still equal HF's."""
    from pagedjax.backends.jax.runner import JaxModelRunner

    monkeypatch.setattr(JaxModelRunner, "min_decode_rows", staticmethod(lambda: 16))
    model_dir = tiny_model("qwen2")
    llm = make_llm(model_dir, max_num_seqs=4, num_gpu_blocks_override=64,
                   max_num_batched_tokens=64)
    assert llm.engine.shapes.seq_buckets == (16,)
    runner, layouts = llm.engine.runner, []
    execute_async = runner.execute_async
    monkeypatch.setattr(runner, "execute_async", lambda model_input: (
        layouts.append(model_input.layout), execute_async(model_input))[1])
    prompts = [p for p in make_prompts(llm.engine.model_config.vocab_size) if len(p) in (1, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 6)
    decodes = [layout for layout in layouts if layout.decode]
    assert decodes and all(layout.num_seqs == 16 for layout in decodes)


def test_branch_free_decode_steps(tiny_model, monkeypatch) -> None:
    """The accelerators' branch-free decode variants (forced on here): PLAIN and FULL compiled
    at startup for each decode layout, neither with a conditional; greedy steps run PLAIN and
    give HF's tokens, a step asking for logprobs runs FULL, and nothing compiles late."""
    from pagedjax.backends.jax import runner as jax_runner
    from pagedjax.backends.jax import step as jax_step

    monkeypatch.setattr(jax_runner, "_branch_free_decode", lambda platform: True)
    monkeypatch.setenv("PAGEDJAX_COMPILE_AT_STARTUP", "1")
    model_dir = tiny_model("llama")
    llm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    decode = [key[0] for key in runner._executables
              if isinstance(key, tuple) and key[1] == jax_step.PLAIN]
    plain = {key: runner._executables[(key, jax_step.PLAIN)] for key in decode}
    full = {key: runner._executables[(key, jax_step.FULL)] for key in decode}
    assert decode and not any(key in runner._executables for key in decode)  # no branched one
    assert all("conditional" not in e.as_text() for e in [*plain.values(), *full.values()])
    used = []
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda executable, model_input: (
        used.append(executable), launch(executable, model_input))[1])

    prompts = [p for p in make_prompts(llm.engine.model_config.vocab_size) if len(p) in (1, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 6)
    assert any(e is plain[layout] for e in used for layout in decode)

    used.clear()
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], with_logprobs,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert all(len(entry) >= 2 for o in again for entry in o.outputs[0].logprobs)
    assert not any(e is p for e in used for p in plain.values())
    assert any(e is f for e in used for f in full.values())
    assert llm.get_metrics()["num_compiles_after_startup"] == 0


def test_decode_steps_alternate_between_two_executable_copies(tiny_model, monkeypatch) -> None:
    """executable_copies 2 (an accelerator's default): startup loads a second copy of every
    decode step, decode steps run the two copies in turn and give HF's tokens; the donated
    last tokens keep their buffer from step to step."""
    monkeypatch.setenv("PAGEDJAX_DISABLE_COMPILE_CACHE", "1")  # jax 0.10's CPU client cannot
    monkeypatch.setenv("PAGEDJAX_COMPILE_AT_STARTUP", "1")  # copy one loaded from the store
    model_dir = tiny_model("llama")
    llm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    runner.executable_copies = 2
    runner.compile([])  # what startup does on an accelerator: every decode step's copy
    decode = [k for k in runner._executables if getattr(k, "decode", False)]
    assert decode and set(decode) <= set(runner._copies)
    used, addresses = [], set()
    launch = runner.launch

    def recording_launch(executable, model_input):
        out = launch(executable, model_input)
        if model_input.layout.decode:
            used.append(executable)
            addresses.add(runner._last_tokens.unsafe_buffer_pointer())
        return out

    monkeypatch.setattr(runner, "launch", recording_launch)
    prompts = make_prompts(llm.engine.model_config.vocab_size)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 8)
    assert len({id(e) for e in used}) >= 2 and set(runner._copies.values()) & set(used)
    assert len(addresses) == 1
