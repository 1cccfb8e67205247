"""Structured outputs on both backends (the demo pair: a trained target and its draft): every
output of the corpus (tests/support/structured_cases.py) is valid, greedy and sampled, plain and
speculative; speculation keeps greedy output and the sampled distribution; preemption,
n > 1 and unconstrained neighbours; the device mask against llguidance's reference."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams, StructuredOutputsParams
from pagedjax.model_loader.demo import demo_model_dirs
from tests.support.structured_cases import CASES, max_tokens_for

BACKENDS = ["jax", "torch"]
TARGET, DRAFT = demo_model_dirs()
SPEC = {"model": DRAFT, "num_speculative_tokens": 4}
PROMPTS = ["The answer is", "def main():\n", "Once upon a time", "# config\n"]


def _llm(backend: str, speculative: bool = False, **kwargs) -> LLM:
    kwargs = {"max_model_len": 512, "max_num_seqs": 64, **kwargs}
    return LLM(TARGET, backend=backend, speculative_config=SPEC if speculative else None,
               **kwargs)


def _requests() -> tuple[list[str], list[SamplingParams], list]:
    """Every corpus case greedy and sampled (temperature 0.8, seeded), two with n = 2."""
    prompts, params, cases = [], [], []
    for i, case in enumerate(CASES):
        for temperature in (0.0, 0.8):
            n = 2 if temperature and i % 8 == 0 else 1
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(SamplingParams(temperature=temperature, seed=i, n=n,
                                         max_tokens=max_tokens_for(case),
                                         structured_outputs=case.params))
            cases.append(case)
    return prompts, params, cases


def _check_all(outputs, cases) -> None:
    for output, case in zip(outputs, cases):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (case.name, completion.text)
            case.check(completion.text)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_output_is_valid_and_speculation_keeps_greedy_output(backend: str) -> None:
    """The corpus (20+ JSON schemas, regexes, choices, grammars), greedy and sampled: every
    output parses and validates, plain and speculative; speculative greedy outputs equal plain
    ones, and some drafts were cut by the grammar (the path that keeps them equal ran)."""
    prompts, params, cases = _requests()
    assert sum(case.kind == "json" for case in CASES) >= 20
    plain = _llm(backend).generate(prompts, params, use_tqdm=False)
    _check_all(plain, cases)
    llm = _llm(backend, speculative=True)
    spec = llm.generate(prompts, params, use_tqdm=False)
    _check_all(spec, cases)
    for a, b, p, case in zip(plain, spec, params, cases):
        if p.is_greedy:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, case.name
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_accepted_tokens"] > 0
    assert metrics["structured_output_tokens_rejected_total"] > 0
    assert metrics["structured_output_requests_total"] == len(params)
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculation_samples_the_constrained_distribution(backend: str) -> None:
    """Sampled at temperature 1 with a choice whose strings share first tokens (so drafts the
    grammar cuts matter): the outputs' frequencies with speculation match those without (a
    two-sample chi-square test; both runs are many seeded requests)."""
    from scipy.stats import chi2_contingency

    choice = ["the cat sat", "the dog sat", "the cat ran", "a dog ran", "a cat"]
    n = 400
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, structured_outputs=(
        StructuredOutputsParams(choice=choice))) for i in range(n)]
    prompts = ["Once upon a time"] * n
    counts = []
    for speculative in (False, True):
        # the corpus test's configuration: its compiled steps are loaded, not compiled again
        outputs = _llm(backend, speculative).generate(prompts, params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outputs]
        assert set(texts) <= set(choice)
        counts.append([texts.count(c) for c in choice])
    table = np.asarray(counts)
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 2, counts
    assert chi2_contingency(table).pvalue > 1e-3, counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_preempted_constrained_request_stays_valid(backend: str) -> None:
    """A pool of 12 blocks of 16 for 8 constrained requests of 2-block prompts: sequences are
    preempted as they grow, and recomputed, their matchers untouched; every output is valid
    and nothing leaks. The grammars are compiled first (one token each), so that the requests
    start together whatever the compile threads' timing: staggered by their compiles, the
    first ones could finish before the last ones started, and nothing be preempted."""
    json_cases = [c for c in CASES if c.kind == "json" and max_tokens_for(c) < 80][:8]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens_for(c),
                             structured_outputs=c.params) for i, c in enumerate(json_cases)]
    llm = _llm(backend, max_model_len=128, num_gpu_blocks_override=12)
    prompt = {"prompt_token_ids": llm.engine.tokenizer.encode("Once upon a time " * 12)[:30]}
    llm.generate([prompt] * len(params), [SamplingParams(max_tokens=1, structured_outputs=c.params)
                                          for c in json_cases], use_tqdm=False)
    before = llm.get_metrics()["num_preemptions_total"]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    _check_all(outputs, json_cases)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions_total"] > before
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unconstrained_rows_equal_their_solo_outputs(backend: str) -> None:
    """Constrained and unconstrained requests in one batch: the unconstrained ones (greedy and
    seeded sampled) produce what they produce alone."""
    free = [SamplingParams(temperature=0.0, max_tokens=24),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24)]
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens_for(c),
                                  structured_outputs=c.params) for i, c in enumerate(CASES[:6])]
    llm = _llm(backend)
    alone = llm.generate(["Once upon a time"] * 2, free, use_tqdm=False)
    mixed = llm.generate(["Once upon a time"] * 8, constrained[:3] + free + constrained[3:],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[3:5]] == [o.outputs[0].token_ids
                                                            for o in alone]
    _check_all(mixed[:3] + mixed[5:], CASES[:6])
    assert not llm.engine.engine_core.structured_output.has_matchers  # released with their requests


def test_an_aborted_constrained_request_leaks_nothing() -> None:
    """Aborted while its grammar compiles, and while it runs: no blocks, matchers or grammars
    stay behind, and the engine serves on."""
    llm = _llm("torch")
    engine = llm.engine
    params = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{40,60}"))
    engine.add_request("waiting", "hi", params)
    engine.add_request("running", "hi", params)
    engine.step()  # both added; grammars compile on the worker thread
    engine.abort_request("waiting")
    while not engine.scheduler.running:
        engine.step()
    engine.abort_request("running")
    finished = {o.request_id: o for o in engine.step() if o.finished}
    assert finished["running"].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    manager = engine.engine_core.structured_output
    assert not manager.has_matchers and not manager.has_waiting and not manager._grammars
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("bad", [
    {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
    {"json": "{not json"},
    {"regex": "a(b"},
    {"grammar": "root ::= ( \"a\" "},
], ids=["schema", "json-text", "regex", "grammar"])
def test_an_invalid_constraint_is_a_value_error_and_the_engine_serves_on(bad: dict) -> None:
    llm = _llm("torch")
    engine = llm.engine
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        engine.add_request("bad", "hi", SamplingParams(
            structured_outputs=StructuredOutputsParams(**bad)))
    good = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    assert llm.generate(["hi"], [good], use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_structured_outputs_params_takes_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize("backend", [*BACKENDS, "torch-reference"])
def test_the_device_mask_is_llguidance_reference(backend: str, monkeypatch) -> None:
    """apply_token_bitmask on each backend equals llguidance's NumPy reference, for a vocabulary
    that is not a multiple of 32 and rows with every, some and one token allowed (torch: its
    C++ pass on the CPU, and the torch ops it stands for elsewhere)."""
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    vocab = 100
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(4, 4), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1
    bitmask[3] = 0
    bitmask[3, 2] = 1 << 5  # token 69 only
    want = logits.copy()
    apply_token_bitmask_inplace(want, bitmask)
    if backend == "jax":
        import jax.numpy as jnp

        from pagedjax.backends.jax.sampler import apply_token_bitmask
        got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    else:
        import torch

        from pagedjax.backends.torch import sampler

        if backend == "torch-reference":
            monkeypatch.setattr(sampler, "ops_backend", lambda: "reference")
        got, argmax = sampler.apply_token_bitmask(torch.from_numpy(logits),
                                                  torch.from_numpy(bitmask))
        assert (argmax is None) == (backend == "torch-reference")
        got = got.numpy()
        if argmax is not None:  # the C++ op's, from the same pass
            np.testing.assert_array_equal(argmax.numpy(), np.argmax(want, axis=-1))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[3]).sum() == 1 and np.isfinite(got[3, 69])


def test_a_row_is_cut_at_the_first_token_its_grammar_forbids() -> None:
    """StructuredOutputManager.accept: a speculative row keeps its tokens up to the first one
    the grammar forbids, its matcher advanced by those; a sampled row's random counter moves
    past the step's, a greedy row's does not; a finished grammar stops its completion."""
    from pagedjax.core.scheduler_output import SampledTokens
    from pagedjax.core.sequence import Sequence
    from pagedjax.model_loader.tokenizer import load_tokenizer
    from pagedjax.structured_output import StructuredOutputManager

    tokenizer = load_tokenizer(TARGET)
    manager = StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    params = {t: SamplingParams(temperature=t, structured_outputs=StructuredOutputsParams(
        regex="[0-9]{4}")) for t in (0.0, 1.0)}
    seqs = {}
    for seq_id, temperature in enumerate((0.0, 1.0)):
        seqs[seq_id] = Sequence(seq_id, f"r{seq_id}", 0, (seq_id, 0), [1, 2], 2,
                                params[temperature], 16, 0)
        manager.add_request(seqs[seq_id], manager.check(params[temperature]))
    while manager.has_waiting:
        manager.wait(timeout=10)
        ready, failed = manager.take_ready()
        assert not failed
    digits = [tokenizer.encode(d, add_special_tokens=False) for d in "1234"]
    assert all(len(d) == 1 for d in digits)
    one, two, three, four = (d[0] for d in digits)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    mask = manager.bitmask([seqs[0], seqs[1]])
    assert mask.shape == (2, (len(tokenizer) + 31) // 32)
    assert ((mask[:, one // 32] >> (one % 32)) & 1 == 1).all()
    assert ((mask[:, letter // 32] >> (letter % 32)) & 1 == 0).all()
    sampled = SampledTokens.from_lists({0: [one, two, letter, three], 1: [one, letter, two]})
    assert manager.accept(seqs, sampled, num_spec_tokens=3) == [seqs[0], seqs[1]]
    assert sampled.as_dict() == {0: [one, two], 1: [one]}
    assert (seqs[0].rng_offset, seqs[1].rng_offset) == (0, 4)
    assert manager.metrics()["structured_output_tokens_rejected_total"] == 4
    for seq_id, tokens in sampled.as_dict().items():
        seqs[seq_id].token_ids += tokens
    assert manager.stopped(list(seqs.values())) == []
    sampled = SampledTokens.from_lists({0: [three, four]})
    assert manager.accept(seqs, sampled, num_spec_tokens=1) == []
    assert sampled.as_dict() == {0: [three, four]}
    assert manager.stopped(list(seqs.values())) == [seqs[0]]


def test_masks_filled_ahead_equal_masks_filled_in_the_step(monkeypatch, caplog) -> None:
    """StructuredOutputManager.fill_ahead: the next step's rows, filled on the filler thread
    while the engine thread goes on, equal those filled in the step, step after step: beside an
    unconstrained row, a request that joins late (filled in the step), a finished one (not
    filled), and a step whose fill ahead fails (its rows filled again in the step)."""
    from pagedjax.core.scheduler_output import SampledTokens
    from pagedjax.core.sequence import Sequence, SequenceStatus
    from pagedjax.model_loader.tokenizer import load_tokenizer
    from pagedjax.structured_output import StructuredOutputManager, mask_filler
    from pagedjax.structured_output.manager import AHEAD_MIN_ROWS
    from tests.support.structured_cases import CASES_BY_NAME

    tokenizer = load_tokenizer(TARGET)
    constraints = [CASES_BY_NAME[name].params for name in
                   ("json_person", "json_nested_user", "regex_phone", "choice_cities")]
    constraints += [StructuredOutputsParams(regex="[a-z]{3,9}@[a-z]{2,6}\\.com"), None,
                    constraints[0]]
    submitted = []
    submit = mask_filler.MaskFiller.submit
    monkeypatch.setattr(mask_filler.MaskFiller, "submit",
                        lambda self, *a: submitted.append(len(a[0])) or submit(self, *a))

    def start(manager, seq_id: int) -> Sequence:
        params = SamplingParams(temperature=0.0, structured_outputs=constraints[seq_id])
        seq = Sequence(seq_id, f"r{seq_id}", 0, (seq_id, 0), [1, 2], 2, params, 64, 0)
        if params.structured_outputs is None:
            return seq
        manager.add_request(seq, manager.check(params))
        while manager.has_waiting:
            manager.wait(timeout=10)
            assert not manager.take_ready()[1]
        return seq

    managers = [StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
                for _ in range(2)]  # [0] fills ahead, [1] only in the step
    seqs = [[start(m, i) for i in range(6)] for m in managers]
    assert len(seqs[0]) - 1 >= AHEAD_MIN_ROWS
    for step in range(12):
        if step == 3:  # a request joins: the step fills its row
            for m, s in zip(managers, seqs):
                s.append(start(m, 6))
        if step == 5:  # one finishes (max_tokens): no row, no fill
            for s in seqs:
                s[1].status = SequenceStatus.FINISHED
        if step == 8:  # the filler fails: the rows are filled again in the step
            class Broken:
                def unsafe_compute_mask_ptr(self, *args) -> None:
                    raise RuntimeError("llguidance failed")

            monkeypatch.setattr(managers[0]._filler, "executor", Broken())
        live = [[seq for seq in s if not seq.is_finished] for s in seqs]
        masks = [m.bitmask(s) for m, s in zip(managers, live)]
        for m, mask in zip(managers, masks):
            m.finish_bitmask(mask)
        np.testing.assert_array_equal(masks[0], masks[1], err_msg=f"step {step}")
        sampled = {}
        for r, seq in enumerate(live[1]):  # an allowed token (any, unconstrained)
            bits = np.unpackbits(masks[1][r].view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: len(tokenizer)])
            sampled[seq.seq_id] = [int(allowed[step % len(allowed)])
                                   if seq.sampling_params.structured_outputs else 5]
        for m, s in zip(managers, live):
            tokens = SampledTokens.from_lists(sampled)
            m.accept({seq.seq_id: seq for seq in s}, tokens, num_spec_tokens=0)
            for seq in s:
                seq.token_ids.append(tokens.as_dict()[seq.seq_id][0])
                if seq in m.stopped(s):
                    seq.status = SequenceStatus.FINISHED
        managers[0].fill_ahead(live[0])
    assert submitted and max(submitted) == 6 and "filling token masks ahead failed" in caplog.text
    for m in managers:
        m.shutdown()
