"""Penalties, logit_bias, prompt_logprobs and ranks end to end on both backends, against HF
transformers on the same tiny checkpoint: `generate` with the NumPy reference as its logits
processor, and one full forward for every logprob. Prompts run in chunks (a 16-token budget),
so the penalties' counts and the prompt's logprobs are assembled across steps.

Tolerances: logprobs within 1e-4 of HF's (float32 forwards of different kernels); tokens, ranks
and top-N ids exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, RequestOutputKind, SamplingParams
from pagedjax.outputs import Logprob
from tests.support.sampling_reference import hf_generate_with_reference, hf_logprobs, reference_rank

BACKENDS = ["jax", "torch"]
CHUNKED = dict(max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=16)
MAX_TOKENS = 10


def make_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, n).tolist() for n in lengths]


def assert_no_leak(llm: LLM) -> None:
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    assert not llm.engine.scheduler.seqs and not llm.engine.has_unfinished_requests()


# Greedy, so HF generate can follow; each knob alone and together, in one batch.
PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                   repetition_penalty=0.5),  # < 1: the model repeats itself
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                   repetition_penalty=1.8),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                   frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                   presence_penalty=-2.0, frequency_penalty=-0.5),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                   logit_bias={17: 4.0, 18: -100, 19: 3.5}, repetition_penalty=1.2,
                   frequency_penalty=0.7),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_penalties_and_logit_bias_match_hf_generate(tiny_model, backend: str) -> None:
    model = tiny_model("llama")
    llm = LLM(model, backend=backend, **CHUNKED)
    prompts = make_prompts((40, 7, 25, 3, 33, 12))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PENALISED,
                           use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    expected = [hf_generate_with_reference(model, p, params, MAX_TOKENS)
                for p, params in zip(prompts, PENALISED)]
    assert got == expected
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], PENALISED[-1],
                         use_tqdm=False)
    changed = sum(o.outputs[0].token_ids != g for o, g in zip(plain, got))
    assert changed >= 4  # the knobs changed what greedy picks
    assert len(set(got[0])) < len(set(got[1]))  # 0.5 repeats, 1.8 avoids repeating
    assert_no_leak(llm)


def assert_logprob_entry(entry: dict[int, Logprob], token: int, hf_row: np.ndarray,
                         num_top: int) -> None:
    """entry: token → Logprob plus the top num_top, against HF's log-probabilities [V]."""
    assert next(iter(entry)) == token  # the scored token first, as vLLM
    assert entry[token].logprob == pytest.approx(hf_row[token], abs=1e-4)
    assert entry[token].rank == reference_rank(hf_row, token)
    top = np.argsort(-hf_row, kind="stable")[:num_top].tolist()
    assert set(entry) == {token, *top}
    assert [entry[t].rank for t in top] == list(range(1, num_top + 1))
    assert [entry[t].logprob for t in top] == pytest.approx(hf_row[top], abs=1e-4)
    assert all(entry[t].decoded_token is not None for t in entry)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_and_ranks_match_a_full_hf_forward(tiny_model, backend: str) -> None:
    """Chunked prefill with prefix caching on and the prompt already cached: a request with
    prompt_logprobs recomputes its prompt (no cache hit) and scores every token of it; sampled
    tokens carry their rank in the whole vocabulary."""
    model = tiny_model("llama")
    llm = LLM(model, backend=backend, enable_prefix_caching=True, **CHUNKED)
    prompt = make_prompts((57,), seed=1)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)  # caches the prompt
    assert llm.generate({"prompt_token_ids": prompt}, greedy,
                        use_tqdm=False)[0].num_cached_tokens == 48
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    completion = out.outputs[0]
    hf = hf_logprobs(model, prompt + completion.token_ids)  # [P + N, V]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert_logprob_entry(out.prompt_logprobs[i], prompt[i], hf[i - 1], 5)
    ranks = []
    for j, token in enumerate(completion.token_ids):
        assert_logprob_entry(completion.logprobs[j], token, hf[len(prompt) + j - 1], 3)
        ranks.append(completion.logprobs[j][token].rank)
    assert max(ranks) > 3  # samples off the top, ranked in the whole vocabulary
    assert completion.cumulative_logprob == pytest.approx(
        sum(hf[len(prompt) + j - 1, t] for j, t in enumerate(completion.token_ids)), abs=1e-3)
    assert_no_leak(llm)


def test_prompt_logprobs_after_preemption_delta_and_one_token_prompts(tiny_model) -> None:
    """A prompt preempted half-way is recomputed: each position is scored once. DELTA sends the
    prompt logprobs with the first output only. A 1-token prompt has nothing to score."""
    model = tiny_model("llama")
    llm = LLM(model, backend="jax", **CHUNKED)
    engine, scheduler = llm.engine, llm.engine.scheduler
    prompt = make_prompts((40,), seed=2)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    engine.add_request("one", {"prompt_token_ids": [7]}, params)
    engine.step()
    engine.step()
    (seq,) = [s for s in scheduler.running if s.request_id == "p"]
    assert 0 < seq.num_computed_tokens < len(prompt)
    scheduler.running.remove(seq)
    scheduler._preempt(seq)  # as the scheduler does when the pool runs out
    outputs: dict[str, list] = {"p": [], "one": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    first, *rest = outputs["p"]
    hf = hf_logprobs(model, prompt)
    assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = first.prompt_logprobs[i]
        assert list(entry) == [prompt[i]]  # prompt_logprobs=0: the prompt token only
        assert entry[prompt[i]].logprob == pytest.approx(hf[i - 1, prompt[i]], abs=1e-4)
        assert entry[prompt[i]].rank == reference_rank(hf[i - 1], prompt[i])
    assert rest and all(o.prompt_logprobs is None for o in rest)
    assert outputs["one"][0].prompt_logprobs == [None]
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculation_keeps_penalised_rows_exact_and_undrafted(tiny_model, backend: str) -> None:
    """With a draft model, greedy output equals the output without one; sequences with
    penalties or logit_bias never draft (their distribution changes with every accepted token)
    while the others do; prompt_logprobs are the same."""
    model = tiny_model("llama")
    spec = {"model": tiny_model("llama"), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [{"prompt_token_ids": p} for p in make_prompts((30, 9, 20, 14), seed=4)]
    params = [PENALISED[1], PENALISED[4], PENALISED[-1],
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             prompt_logprobs=2)]
    results, scheduled = {}, []
    for name, speculative_config in (("plain", None), ("spec", spec)):
        llm = LLM(model, backend=backend, speculative_config=speculative_config, **CHUNKED)
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule
        scheduler.schedule = lambda *args, schedule=schedule, **kwargs: scheduled.append(
            schedule(*args, **kwargs)) or scheduled[-1]
        scheduled.clear()
        results[name] = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leak(llm)
    assert ([o.outputs[0].token_ids for o in results["spec"]]
            == [o.outputs[0].token_ids for o in results["plain"]])
    # a fresh engine: the i-th request is sequence i
    num_drafts = [sum(n for step in scheduled
                      for seq_id, n in zip(step.seq_ids, step.num_spec_tokens_per_seq)
                      if seq_id == i) for i in range(len(prompts))]
    assert num_drafts[0] == num_drafts[1] == 0 and num_drafts[2] > 0 and num_drafts[3] > 0
    plain_lps, spec_lps = (results[n][3].prompt_logprobs for n in ("plain", "spec"))
    assert len(spec_lps) == 14 and spec_lps[0] is None
    for a, b in zip(plain_lps[1:], spec_lps[1:]):
        assert list(a) == list(b)
        assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()],
                                                                abs=1e-5)
