"""Penalties and logit_bias on fixed logits: each backend's sampler against the NumPy reference
(tests/support/sampling_reference.py), fed through the packed batch exactly as the engine builds it
(Sequence → SampleSpec → build_model_input), with the sampled tokens' logprobs and ranks.

Tolerances: processed logits within 1e-5 (float32 ops in the same order; only division and
multiplication rounding may differ by an ulp); tokens and ranks exact.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax import rng as prng
from pagedjax.backends.jax import rejection_sampler as jax_rejection
from pagedjax.backends.jax import sampler as jax_sampler
from pagedjax.backends.torch import rejection_sampler as torch_rejection
from pagedjax.backends.torch import sampler as torch_sampler
from pagedjax.core.batch import SAMPLING_FIELDS, ModelInput
from pagedjax.core.batch_reference import build_model_input
from pagedjax.core.scheduler_output import SampleSpec, ScheduledBatch, ScheduledSequence
from pagedjax.core.sequence import Sequence
from pagedjax.core.step_shapes import StepShapes
from pagedjax.sampling_params import SamplingParams
from tests.support.sampling_reference import log_softmax, reference_logits, reference_rank

VOCAB = 300
BLOCK_SIZE = 16
SHAPES = StepShapes.for_engine(max_num_seqs=16, max_num_batched_tokens=64, max_blocks_per_seq=4,
                               max_model_len=64)


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
    out = ScheduledBatch(entries)
    return build_model_input(out, SHAPES, block_size=BLOCK_SIZE)


def device_inputs(model_input: ModelInput, backend: str, **flags: bool) -> tuple[dict, object]:
    """The sampler's inputs on a backend as its runner makes them: the knobs, the logit
    entries, and the step's flags (overridden by `flags`)."""
    f = model_input.fields()
    sampling = {name: f[name] for name in SAMPLING_FIELDS}
    seeds = {name: f[name].view(np.uint32) for name in ("rng_seed", "rng_step")}
    step_flags = dataclasses.replace(model_input.flags, **flags)
    entries = model_input.entries
    if backend == "jax":
        out = {**{k: jnp.asarray(v) for k, v in sampling.items()},
               **{k: jnp.asarray(v) for k, v in seeds.items()},
               "entries": (jnp.asarray(entries.ints), jnp.asarray(entries.bias))}
        return out, jnp.asarray(step_flags.as_array()) != 0
    n = entries.num_entries
    out = {**{k: torch.from_numpy(v.copy()) for k, v in sampling.items()},
           **{k: torch.from_numpy(v.astype(np.int64)) for k, v in seeds.items()},
           "entries": (torch.from_numpy(entries.ints[:, :n]), torch.from_numpy(entries.bias[:n]))}
    return out, step_flags


SAMPLERS = {"jax": (jax_sampler, jnp.asarray, np.asarray),
            "torch": (torch_sampler, torch.from_numpy, lambda t: t.numpy())}


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, list, ModelInput]:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (16, VOCAB)).astype(np.float32)
    rows = make_rows(logits, rng)
    return logits, rows, pack(rows)


def test_penalised_steps_pack_only_what_they_need(case) -> None:
    """One entry per distinct (row, token) the penalties and biases touch: a repetition row's
    distinct prompt tokens, a penalised row's distinct output tokens (with their counts), each
    bias; the step keeps the plain decode shape."""
    _, rows, model_input = case
    def touched(params: SamplingParams, prompt: list[int], output: list[int]) -> set[int]:
        seen = set(prompt) if params.repetition_penalty != 1.0 else set()
        counted = set(output) if params.has_penalties else set()
        return seen | counted | set(params.logit_bias or ())

    expected = sum(len(touched(*row)) for row in rows)
    entries = model_input.entries
    assert model_input.flags.logit_entries and entries.num_entries == expected
    assert model_input.layout == SHAPES.decode_layout(len(rows))
    assert (entries.ints[0, expected:] == -1).all()
    assert entries.ints[2].sum() == 7 * 8  # every output occurrence of the penalised rows
    assert set(entries.ints[0, :expected]) == {1, 2, 3, 4, 5, 6, 7, 8, 9}


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_processed_logits_match_numpy(case, backend: str) -> None:
    logits, rows, model_input = case
    module, to_device, to_numpy = SAMPLERS[backend]
    sampling, flags = device_inputs(model_input, backend)
    flags = (flags,) if backend == "jax" else ()  # torch decides on the host
    got = module.process_logits(to_device(logits), sampling, *flags)
    got = to_numpy(got[0] if backend == "torch" else got)  # torch: (logits, argmax)
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
            to_device(logits), *device_inputs(model_input, backend, logprobs=True,
                                              filters=False)))
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
    sampling, flags = device_inputs(model_input, backend, filters=False)
    flags = dict(all_greedy=False, use_filters=False) if backend == "torch" else dict(flags=flags)
    tokens, num_accepted = rejection.rejection_sample(
        to_device(target), to_device(drafts), to_device(probs),
        to_device(np.zeros(num_rows, np.int32)), sampling, **flags)
    tokens = to_numpy(tokens)
    assert not to_numpy(num_accepted).any()
    for r, (params, prompt, output) in enumerate(rows):
        if params.is_greedy:
            assert tokens[r, 0] == np.argmax(reference_logits(logits[r], params, prompt, output))
    assert tokens[8, 0] == 5
