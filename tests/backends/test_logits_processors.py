"""Penalties and logit_bias on fixed logits: each backend's sampler against the NumPy reference
(tests/sampling_reference.py), fed through the packed batch exactly as the engine builds it
(Sequence → SampleSpec → build_model_input), with the sampled tokens' logprobs and ranks.

Tolerances: processed logits within 1e-5 (float32 ops in the same order; only division and
multiplication rounding may differ by an ulp); tokens and ranks exact.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax import random as prng
from pagedjax.backends.jax import rejection_sampler as jax_rejection
from pagedjax.backends.jax import sampler as jax_sampler
from pagedjax.backends.torch import rejection_sampler as torch_rejection
from pagedjax.backends.torch import sampler as torch_sampler
from pagedjax.core.batch import SAMPLING_FIELDS, ModelInput, build_model_input
from pagedjax.core.scheduler_output import SampleSpec, ScheduledSequence, SchedulerOutput
from pagedjax.core.sequence import Sequence
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.sampling_reference import log_softmax, reference_logits, reference_rank

VOCAB = 300
BLOCK_SIZE = 16


def make_rows(logits: np.ndarray, rng: np.random.Generator) -> list[tuple[SamplingParams,
                                                                         list[int], list[int]]]:
    """(params, prompt, output) per row; outputs repeat each row's likeliest tokens, so the
    penalties move the argmax."""
    top = np.argsort(-logits, axis=-1)[:, :4]  # [L, 4]
    rows = [
        SamplingParams(temperature=0.0),  # untouched among processed rows
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.6),  # < 1 favours seen tokens
        SamplingParams(temperature=0.0, frequency_penalty=1.7),
        SamplingParams(temperature=0.0, presence_penalty=-2.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=-0.5,
                       repetition_penalty=1.3, logit_bias={3: 7.5, 9: -1.0}),
        SamplingParams(temperature=0.0, logit_bias={int(top[6, 0]): -100.0}),
        SamplingParams(temperature=0.9, frequency_penalty=2.0, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, logit_bias={5: 300.0, 6: -100.0, 7: 2.5}),  # clamped
        SamplingParams(temperature=0.7, presence_penalty=1.0, top_p=1.0),
    ]
    out = []
    for r, params in enumerate(rows):
        prompt = rng.integers(0, VOCAB, 20).tolist() + [int(top[r, 1])]
        output = [int(top[r, 0])] * 3 + [int(top[r, 2])] + rng.integers(0, VOCAB, 4).tolist()
        out.append((params, prompt, output))
    return out


def pack(rows: list[tuple[SamplingParams, list[int], list[int]]]) -> ModelInput:
    """One decode step of these sequences, built as the scheduler and the engine build it."""
    entries = []
    for seq_id, (params, prompt, output) in enumerate(rows):
        seq = Sequence(seq_id, str(seq_id), 0, (seq_id, 0), prompt + output, len(prompt),
                       params, 16, rng_seed=1000 + seq_id)
        spec = SampleSpec(seq_id, params, seq.rng_seed, len(output), [], *seq.penalty_token_ids())
        start = seq.num_tokens - 1
        entries.append(ScheduledSequence(seq_id, seq.token_ids[start:], start,
                                         list(range(seq.num_tokens // BLOCK_SIZE + 1)), [spec]))
    out = SchedulerOutput(entries, [], [], len(entries))
    return build_model_input(out, block_size=BLOCK_SIZE, max_blocks_per_seq=4)


def device_sampling(model_input: ModelInput, backend: str) -> dict:
    f = model_input.fields()
    sampling = {name: f[name] for name in SAMPLING_FIELDS if name in f}
    seeds = {name: f[name].view(np.uint32) for name in ("rng_seed", "rng_step")}
    if backend == "jax":
        return {**{k: jnp.asarray(v) for k, v in sampling.items()},
                **{k: jnp.asarray(v) for k, v in seeds.items()}}
    return {**{k: torch.from_numpy(v.copy()) for k, v in sampling.items()},
            **{k: torch.from_numpy(v.astype(np.int64)) for k, v in seeds.items()}}


SAMPLERS = {"jax": (jax_sampler, jnp.asarray, np.asarray),
            "torch": (torch_sampler, torch.from_numpy, lambda t: t.numpy())}


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, list, ModelInput]:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (16, VOCAB)).astype(np.float32)
    rows = make_rows(logits, rng)
    return logits, rows, pack(rows)


def test_penalised_steps_pack_only_what_they_need(case) -> None:
    _, rows, model_input = case
    layout = model_input.layout
    penalised = [r for r in rows if r[0].has_penalties]
    # repetition rows send their distinct prompt tokens; every penalised row its output
    expected = sum(len(set(p)) * (params.repetition_penalty != 1.0) + len(o)
                   for params, p, o in penalised)
    assert 128 < expected <= 4 * 21 + 7 * 8  # 4 repetition rows, 7 penalised rows
    assert layout.num_penalty_tokens == 256 and layout.num_logit_bias == 8  # 2 + 1 + 3 biases
    f = model_input.fields()
    assert (f["penalty_rows"] >= 0).sum() == expected and f["penalty_counts"].sum() == 7 * 8
    assert set(f["penalty_rows"][f["penalty_rows"] >= 0]) == {1, 2, 3, 4, 5, 7, 9}
    assert len(layout.float_fields) == 7 and layout.float_size == 6 * 16 + 8


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_processed_logits_match_numpy(case, backend: str) -> None:
    logits, rows, model_input = case
    module, to_device, to_numpy = SAMPLERS[backend]
    got = to_numpy(module.process_logits(to_device(logits), device_sampling(model_input,
                                                                            backend)))
    for r, (params, prompt, output) in enumerate(rows):
        expected = reference_logits(logits[r], params, prompt, output)
        np.testing.assert_allclose(got[r], expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[len(rows):], logits[len(rows):])  # padding rows


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_sampled_tokens_logprobs_and_ranks_match_numpy(case, backend: str) -> None:
    """Greedy rows take the reference argmax; random rows the reference Gumbel-max with the
    shared counters; logprobs are the raw model's, ranks their argsort position."""
    logits, rows, model_input = case
    module, to_device, to_numpy = SAMPLERS[backend]
    tokens, logprobs, top_ids, _, ranks = (
        to_numpy(x) for x in module.sample(
            to_device(logits), device_sampling(model_input, backend),
            num_top_logprobs=MAX_LOGPROBS, all_greedy=False, use_filters=False))
    raw = log_softmax(logits)
    f = model_input.fields()
    for r, (params, prompt, output) in enumerate(rows):
        processed = reference_logits(logits[r], params, prompt, output)
        if params.is_greedy:
            expected = int(np.argmax(processed))
        else:
            u = prng.uniform(f["rng_seed"].view(np.uint32)[r : r + 1],
                             f["rng_step"].view(np.uint32)[r : r + 1], VOCAB)[0]
            expected = int(np.argmax(processed / np.float32(params.temperature)
                                     - np.log(-np.log(u))))
        assert tokens[r] == expected, r
        assert ranks[r] == reference_rank(raw[r], expected)
        np.testing.assert_allclose(logprobs[r], raw[r, expected], atol=1e-5)
        np.testing.assert_array_equal(top_ids[r], np.argsort(-raw[r], kind="stable")[:20])
    assert ranks[: len(rows)].max() > 1  # the knobs did move some samples off the top token
    assert tokens[8] == 5  # logit_bias +100 (clamped from 300) wins


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_rejection_path_processes_rows_without_drafts(case, backend: str) -> None:
    """In a speculative step a penalised row verifies no drafts: its token comes from the same
    processed logits as without speculation."""
    logits, rows, model_input = case
    module, to_device, to_numpy = SAMPLERS[backend]
    rejection = jax_rejection if backend == "jax" else torch_rejection
    num_rows = logits.shape[0]
    target = np.stack([logits, np.roll(logits, 1, axis=0)], axis=1)  # [L, 2, V]
    drafts = np.zeros((num_rows, 1), np.int32)
    probs = np.full((num_rows, 1, VOCAB), 1.0 / VOCAB, np.float32)
    tokens, num_accepted = rejection.rejection_sample(
        to_device(target), to_device(drafts), to_device(probs),
        to_device(np.zeros(num_rows, np.int32)), device_sampling(model_input, backend),
        all_greedy=False, use_filters=False)
    tokens = to_numpy(tokens)
    assert not to_numpy(num_accepted).any()
    for r, (params, prompt, output) in enumerate(rows):
        if params.is_greedy:
            assert tokens[r, 0] == np.argmax(reference_logits(logits[r], params, prompt, output))
    assert tokens[8, 0] == 5
