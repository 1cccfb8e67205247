"""Speculative decoding end to end: greedy output is exactly the output without speculation."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from tests.backends.test_jax_backend import make_prompts

BACKENDS = ["jax", "torch"]
# jax's speculative steps launch before the last one's tokens reach the host (async
# speculation); "jax-sync" (PAGEDJAX_ASYNC_SPECULATION=0) waits for them; "torch-ahead" launches
# them ahead as on a GPU (PAGEDJAX_ASYNC_SPECULATION=1, its runner told it launches
# asynchronously, as test_async_scheduling does); their outputs are jax's and torch's
DRAFT_BACKENDS = [*BACKENDS, "jax-sync", "torch-ahead"]
AHEAD = ("jax", "torch-ahead")
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(target: str, backend: str, draft: str | None = None, k: int = 3,
             adaptive: bool = True, **kwargs) -> LLM:
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": k,
                                       "adaptive": adaptive}
    kwargs = {"num_gpu_blocks_override": 96, "max_num_batched_tokens": 256, **kwargs}
    with mock.patch.dict(os.environ, {"PAGEDJAX_ASYNC_SPECULATION": str(int(backend in AHEAD))}):
        llm = LLM(target, backend=same_as(backend), max_model_len=256, speculative_config=spec,
                  **kwargs)
    if backend == "torch-ahead":
        llm.engine.runner.async_launch = True  # as on CUDA (a CPU computes as it is called)
    return llm


def same_as(backend: str) -> str:
    """The backend whose outputs `backend`'s equal."""
    return backend.split("-")[0]


def launched_ahead(llm: LLM) -> int:
    return llm.engine.engine_core.overlap.num_speculative_ahead


def prompts(llm: LLM, n: int = 5) -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts(llm.engine.model_config.vocab_size)][:n]


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[str, list[list[int]]]:
    """Greedy tokens without speculation, per backend."""
    out = {}
    for backend in BACKENDS:
        llm = make_llm(tiny_model("llama"), backend)
        out[backend] = [o.outputs[0].token_ids
                        for o in llm.generate(prompts(llm), GREEDY, use_tqdm=False)]
    return out


def assert_no_leak(llm: LLM) -> None:
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    assert not llm.engine.scheduler.seqs and not llm.engine.has_unfinished_requests()
    block_manager = llm.engine.block_manager
    assert all(block_manager.ref_count(b) == 0 for b in range(block_manager.num_blocks))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_name", ["draft", "llama"])
@pytest.mark.parametrize("backend", DRAFT_BACKENDS)
def test_greedy_speculation_is_exact(tiny_model, reference, backend: str, draft_name: str,
                                     k: int) -> None:
    llm = make_llm(tiny_model("llama"), backend, tiny_model(draft_name), k)
    outputs = llm.generate(prompts(llm), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[same_as(backend)]
    assert (launched_ahead(llm) > 0) == (backend in AHEAD)
    metrics = llm.get_metrics()
    drafted, accepted = (metrics["spec_decode_num_draft_tokens"],
                         metrics["spec_decode_num_accepted_tokens"])
    assert drafted > 0
    if draft_name == "llama":  # draft == target: every draft accepted, k + 1 tokens per step
        assert accepted == drafted
        assert metrics["spec_decode_acceptance_per_position"] == [1.0] * k
    else:
        assert accepted < drafted / 2
    assert_no_leak(llm)


@pytest.mark.usefixtures("compile_at_startup")
@pytest.mark.parametrize("backend", DRAFT_BACKENDS)
def test_adaptive_speculation_is_exact(tiny_model, reference, backend: str) -> None:
    """The adaptive policy chooses among the compiled ks 0, 2 and 4 step by step; greedy
    output stays exactly the output without a draft. Its step-time table is measured at startup
    (checked for every bucket and k), then replaced by one where drafting costs no more than a
    plain step: whether drafting pays on this machine is timing, not what is tested here."""
    llm = make_llm(tiny_model("llama"), backend, tiny_model("draft"), k=4, max_num_seqs=8)
    speculation, shapes = llm.engine.engine_core.speculation, llm.engine.shapes
    assert speculation.adaptive and shapes.spec_ks == (2, 4)
    assert {s: sorted(row) for s, row in speculation.costs.items()} == {
        s: [0, 2, 4] for s in shapes.seq_buckets}
    assert all(t > 0 for row in speculation.costs.values() for t in row.values())
    speculation.costs = {s: {k: 1e-3 for k in row} for s, row in speculation.costs.items()}
    outputs = llm.generate(prompts(llm), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[same_as(backend)]
    steps_per_k = llm.get_metrics()["spec_decode_steps_per_k"]
    assert sum(steps_per_k[1:]) > 0
    assert llm.get_metrics()["num_compiles_after_startup"] == 0
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", DRAFT_BACKENDS)
def test_stop_token_inside_accepted_drafts(tiny_model, reference, backend: str) -> None:
    """A stop token among accepted drafts ends the completion right there."""
    llm = make_llm(tiny_model("llama"), backend, tiny_model("llama"), k=5)
    want = reference[same_as(backend)][4]
    stop = want[6]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                            ignore_eos=True)
    completion = llm.generate(prompts(llm)[4], params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == want[: want.index(stop) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    short = llm.generate(prompts(llm)[4], SamplingParams(temperature=0.0, max_tokens=7,
                                                          ignore_eos=True), use_tqdm=False)
    assert short[0].outputs[0].token_ids == want[:7]  # max_tokens mid-draft
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", DRAFT_BACKENDS)
def test_logprobs_with_speculation(tiny_model, backend: str) -> None:
    """Accepted drafts, recovered and bonus tokens carry the target's logprobs and top-N."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    plain = make_llm(tiny_model("llama"), same_as(backend))
    spec = make_llm(tiny_model("llama"), backend, tiny_model("llama"), k=3)
    want = plain.generate(prompts(plain)[3], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(prompts(spec)[3], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == 10
    for mine, theirs in zip(got.logprobs, want.logprobs):
        assert mine.keys() == theirs.keys()
        assert all(mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4) for t in mine)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("backend", DRAFT_BACKENDS)
def test_parallel_sampling_with_speculation(tiny_model, reference, backend: str) -> None:
    """n=2 forks share the prompt's blocks; each sibling then speculates on its own."""
    llm = make_llm(tiny_model("llama"), backend, tiny_model("draft"), k=2)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts(llm)[1:4], params, use_tqdm=False)
    for output, want in zip(outputs, reference[same_as(backend)][1:4]):
        assert [c.token_ids for c in output.outputs] == [want, want]
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", AHEAD)
def test_async_speculation_samples_what_the_synchronous_engine_samples(tiny_model,
                                                                        backend: str) -> None:
    """Seeded sampling draws from a completion's own random stream, counted by its tokens: the
    speculative steps launched ahead (moved on the device by the drafts the last one accepted)
    sample every token the synchronous engine does at the same k, with top-p, logprobs and a
    stop token. The draft is the target (so that sampled drafts are accepted, some steps all
    of them)."""
    params = [SamplingParams(temperature=t, top_p=0.9, max_tokens=40, seed=i, logprobs=1,
                             ignore_eos=True) for i, t in enumerate((0.2, 0.3, 0.5, 0.8))]
    params.append(SamplingParams(temperature=0.3, max_tokens=40, seed=7, ignore_eos=True,
                                 stop_token_ids=[5]))
    waiting = {"jax": "jax-sync", "torch-ahead": "torch"}[backend]
    got = {}
    for engine in (waiting, backend):
        llm = make_llm(tiny_model("llama"), engine, tiny_model("llama"), k=3, adaptive=False)
        outputs = llm.generate(prompts(llm), params, use_tqdm=False)
        got[engine] = [(c.token_ids, [round(lp[t].logprob, 4) for lp, t in
                                      zip(c.logprobs or [], c.token_ids)], c.finish_reason)
                       for o in outputs for c in o.outputs]
        metrics = llm.get_metrics()
        assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics[
            "spec_decode_num_draft_tokens"]
        assert_no_leak(llm)
    assert launched_ahead(llm) > 0
    assert got[backend] == got[waiting]


@pytest.mark.slow
@pytest.mark.parametrize("backend", DRAFT_BACKENDS)
def test_speculation_under_pressure(tiny_model, reference, backend: str) -> None:
    """Chunked prefill, a pool short enough to drop drafts and preempt, prefix-cache hits,
    aborts and sampled requests: still exact for greedy, and nothing leaks."""
    pressure = dict(num_gpu_blocks_override=16, max_num_batched_tokens=48)
    plain = make_llm(tiny_model("llama"), same_as(backend), **pressure)
    inputs = prompts(plain, 10) + prompts(plain, 3)  # the repeats hit the prefix cache
    want = [o.outputs[0].token_ids for o in plain.generate(inputs, GREEDY, use_tqdm=False)]
    llm = make_llm(tiny_model("llama"), backend, tiny_model("draft"), k=3, **pressure)
    outputs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    metrics = llm.get_metrics()
    assert metrics["num_preemptions_total"] > 0 and metrics["prefix_cache_hits"] > 0
    engine = llm.engine
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_TOKENS, seed=3)
    for i, prompt in enumerate(inputs[:4]):
        engine.add_request(f"s{i}", prompt, sampled if i % 2 else GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("s0")
    engine.abort_request("s3")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)


def test_draft_must_share_the_vocabulary(tiny_model, tmp_path) -> None:
    from pagedjax.testing.checkpoints import make_tiny_checkpoint, stdlib_corpus, train_tokenizer

    other = make_tiny_checkpoint(tmp_path / "other", "llama",
                                 tokenizer=train_tokenizer(stdlib_corpus()[:1], vocab_size=300))
    with pytest.raises(ValueError, match="does not share the target"):
        make_llm(tiny_model("llama"), "jax", str(other))
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        make_llm(tiny_model("llama"), "jax", tiny_model("draft"), k=0)


# ---- draft-free methods (n-gram, suffix): drafts from the host, verified by the target alone ---

HOST_METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
}
# Prompts that repeat themselves (code to rewrite, a quote), where lookups find drafts.
HOST_PROMPTS = [
    "def area(width, height):\n    return width * height\n\n# The same function, typed:\n"
    "def area(width: float, height: float) -> float:\n",
    "The cat sat on the mat. The dog sat on the rug. The cat sat on",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
]


@pytest.fixture(scope="module", params=BACKENDS)
def host_engines(request) -> dict[str, LLM]:
    """Engines on the demo target, one backend: "plain" (no speculation) and one per method."""
    from pagedjax.model_loader.demo import demo_model_dirs

    target, _ = demo_model_dirs()
    kwargs = dict(backend=request.param, max_model_len=256, max_num_seqs=16,
                  num_gpu_blocks_override=96)
    return {"plain": LLM(target, **kwargs),
            **{m: LLM(target, speculative_config=c, **kwargs) for m, c in HOST_METHODS.items()}}


@pytest.mark.parametrize("method", list(HOST_METHODS))
def test_host_drafts_greedy_is_exact(host_engines, method: str) -> None:
    """Greedy output equals the output without speculation: single and n = 2 completions, a
    structured choice, with drafts found and kept; nothing leaks."""
    from pagedjax.sampling_params import StructuredOutputsParams

    plain, llm = host_engines["plain"], host_engines[method]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2),
              SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=(
                  StructuredOutputsParams(choice=["The cat sat on the mat", "The dog"])))]
    want = plain.generate(HOST_PROMPTS, params, use_tqdm=False)
    got = llm.generate(HOST_PROMPTS, params, use_tqdm=False)
    for mine, theirs in zip(got, want):
        assert [c.token_ids for c in mine.outputs] == [c.token_ids for c in theirs.outputs]
    for mine, theirs in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs):
        assert mine.keys() == theirs.keys()  # verified rows score as decoded ones
        assert [x.logprob for x in mine.values()] == pytest.approx(
            [x.logprob for x in theirs.values()], abs=1e-4)
    assert got[2].outputs[0].text in ("The cat sat on the mat", "The dog")
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_accepted_tokens"] > 0
    assert metrics["spec_decode_num_draft_tokens"] > metrics["spec_decode_num_accepted_tokens"]
    assert_no_leak(llm)


@pytest.mark.parametrize("method", list(HOST_METHODS))
def test_host_drafts_sample_the_targets_distribution(host_engines, method: str) -> None:
    """Sampled at temperature 0.5 (seeded requests): the tokens at each of the first output
    positions are distributed as without speculation (a two-sample chi-square test per
    position, pooled over 300 requests), while drafts are accepted."""
    from scipy.stats import chi2_contingency

    plain, llm = host_engines["plain"], host_engines[method]
    n, length = 300, 6
    prompt = ("import os\n\ndef main():\n    x = os.path.join(a, b)\n"
              "    y = os.path.join(c, d)\n    z = os.path.")
    params = [SamplingParams(temperature=0.5, seed=i, max_tokens=length, ignore_eos=True)
              for i in range(n)]
    before = llm.get_metrics()["spec_decode_num_accepted_tokens"]
    runs = [[o.outputs[0].token_ids for o in engine.generate([prompt] * n, params,
                                                             use_tqdm=False)]
            for engine in (plain, llm)]
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > before + n // 10
    for j in range(1, length):  # position 0 is sampled before any draft exists
        tokens = sorted({run[i][j] for run in runs for i in range(n)})
        table = np.array([[sum(run[i][j] == t for i in range(n)) for t in tokens]
                          for run in runs])
        frequent = table.sum(axis=0) >= 10  # rare tokens pooled into one column
        table = np.column_stack([table[:, frequent], table[:, ~frequent].sum(axis=1)])
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] >= 2:
            assert chi2_contingency(table).pvalue > 1e-3, (j, table)
    assert_no_leak(llm)


def test_host_drafts_verify_on_their_rows_alone() -> None:
    """A step verifying the host's drafts runs the head on its real token rows, each
    sequence's last token and the drafts it proposed (d + 1 rows), not K + 1 rows for every
    sequence: in a step where a sequence matched nothing, fewer than L (K + 1) rows. Counted
    on torch, whose head is called with its rows; jax's step passes the same count to its
    head as a traced value (tests/backends/test_verifying_logits.py)."""
    from pagedjax.model_loader.demo import demo_model_dirs

    llm = LLM(demo_model_dirs()[0], backend="torch", max_model_len=256, max_num_seqs=16,
              num_gpu_blocks_override=96, speculative_config=HOST_METHODS["ngram"])
    runner = llm.engine.runner
    target, seen, verifying = runner.models[0], [], []
    forward, step = target.forward, type(runner.step).__call__

    def counting(input_ids, kv_caches, meta, logits_indices):
        seen.append((input_ids.shape[0], logits_indices.numel()))  # (real tokens, head rows)
        return forward(input_ids, kv_caches, meta, logits_indices)

    def recording(self, *args, layout, **kwargs):
        seen.clear()
        out = step(self, *args, layout=layout, **kwargs)
        if layout.num_spec_tokens:
            verifying.append((*seen[0], layout.num_seqs * (layout.num_spec_tokens + 1)))
        return out

    target.forward = counting
    try:
        with mock.patch.object(type(runner.step), "__call__", recording):
            llm.generate(HOST_PROMPTS, SamplingParams(temperature=0.0, max_tokens=24,
                                                      ignore_eos=True), use_tqdm=False)
    finally:
        del target.forward  # the class's method again
    assert verifying
    assert all(head == real for real, head, _ in verifying), verifying
    assert any(head < full for _, head, full in verifying), verifying
    assert_no_leak(llm)
    llm.shutdown()


def test_suffix_decoding_drafts_from_earlier_outputs(host_engines) -> None:
    """A task sent again (an agent's loop): the second time, the global tree holds the first
    answer, so most of it comes as accepted drafts; the finished requests' trees are freed."""
    plain, llm = host_engines["plain"], host_engines["suffix"]
    prompt = "class Stack:\n    def __init__(self):\n"
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    accepted = []
    for _ in range(2):
        before = llm.get_metrics()["spec_decode_num_accepted_tokens"]
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
        accepted.append(llm.get_metrics()["spec_decode_num_accepted_tokens"] - before)
    assert accepted[1] >= max(2 * accepted[0], len(want) // 2), accepted
    drafter = llm.engine.engine_core.drafter
    llm.generate("x = 1", SamplingParams(max_tokens=2), use_tqdm=False)  # a step after them
    assert drafter.proposer.num_cached_requests >= 2
    assert_no_leak(llm)


@pytest.mark.usefixtures("compile_at_startup")
def test_host_drafts_are_scored_while_drafting_is_off(host_engines) -> None:
    """An adaptive n-gram engine whose policy drafts nothing (held at k = 0 here) still
    proposes a few sequences' drafts and scores them against the tokens those then decode
    (host_drafts.ShadowDrafts): the acceptance it decides on moves, no draft is verified,
    and greedy output is the output without speculation."""
    from pagedjax.core.host_drafts import ShadowDrafts
    from pagedjax.model_loader.demo import demo_model_dirs

    plain = host_engines["plain"]
    llm = LLM(demo_model_dirs()[0], backend=plain.engine.config.backend, max_model_len=256,
              max_num_seqs=16, num_gpu_blocks_override=96,
              speculative_config={**HOST_METHODS["ngram"], "adaptive": True})
    speculation = llm.engine.engine_core.speculation
    assert speculation.adaptive and llm.engine.engine_core.shadow_drafts is not None
    speculation.choose = lambda num_seqs: 0  # drafting off: neither probes nor tries
    speculation._chosen = 0
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = plain.generate(HOST_PROMPTS, params, use_tqdm=False)
    got = llm.generate(HOST_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] == 0
    assert speculation._drafted[0] > 0 and speculation._accepted[0] > 0
    assert len(llm.engine.engine_core.shadow_drafts.pending) <= ShadowDrafts.NUM_SEQS
    assert_no_leak(llm)
