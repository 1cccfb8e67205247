"""The torch sampler must sample exactly what the JAX sampler samples, knob for knob."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax import rng as prng
from pagedjax.backends.jax import sampler as jax_sampler
from pagedjax.backends.torch import sampler as torch_sampler
from pagedjax.core.batch import StepFlags
from pagedjax.core.logit_entries import build_logit_entries
from pagedjax.core.scheduler_output import SampleSpec
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams

# One row per knob mix: (temperature, top_k, top_p, min_p); 0 temperature = greedy.
ROWS = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.8, 0, 0.9, 0.0),
    (1.0, 0, 0.3, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.0, 0, 1.0, 0.5),
    (0.9, 50, 0.8, 0.02),
    (2.0, 10, 0.95, 0.1),
    (0.0, 5, 0.5, 0.1),  # greedy ignores the filters
    (1.0, 100_000, 1.0, 0.0),  # top_k above the vocabulary
    (1e-3, 0, 1.0, 0.0),
]


def _metadata(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    num_rows = len(ROWS)
    temperature, top_k, top_p, min_p = (np.array(c) for c in zip(*ROWS))
    return {
        "temperature": temperature.astype(np.float32), "top_k": top_k.astype(np.int32),
        "top_p": top_p.astype(np.float32), "min_p": min_p.astype(np.float32),
        "rng_seed": rng.integers(0, 2**32, num_rows, dtype=np.uint32),
        "rng_step": rng.integers(0, 2**32, num_rows, dtype=np.uint32),
        "presence_penalty": np.zeros(num_rows, np.float32),
        "frequency_penalty": np.zeros(num_rows, np.float32),
        "repetition_penalty": np.ones(num_rows, np.float32),
    }


def _specs(logits: np.ndarray, processors: bool, seed: int) -> list[SampleSpec]:
    """Each row's banned tokens (the argmax of a greedy and a random row, plus a few others)
    and, with processors, penalties on rows 1, 3, 5, 9 and 11 (counting each row's likeliest
    tokens) and logit_bias on rows 0, 2 and 9: what build_logit_entries packs."""
    rng = np.random.default_rng(seed + 100)
    top = np.argsort(-logits, axis=-1)[:, :3]  # [L, 3]
    banned = {0: [int(logits[0].argmax()), 3], 1: [int(logits[1].argmax())], 5: [7]}
    bias = {0: {int(top[0, 0]): -100.0, 4: 3.0}, 2: {11: 100.0}, 9: {int(top[9, 1]): 2.5}}
    specs = []
    for r in range(len(ROWS)):
        prompt, output, row_bias = [], [], None
        if processors and r in (1, 3, 5, 9, 11):
            prompt = sorted({int(top[r, 1]), *rng.integers(0, logits.shape[1], 6).tolist()})
            output = [int(top[r, 0])] * 2 + [int(top[r, 2])]
        if processors:
            row_bias = bias.get(r)
        specs.append(SampleSpec(r, SamplingParams(logit_bias=row_bias), 0, 0, banned.get(r, []),
                                prompt, output))
    return specs


def _set_penalties(meta: dict[str, np.ndarray]) -> None:
    rows = [1, 3, 5, 9, 11]
    meta["presence_penalty"][rows] = [2.0, -1.0, 2.0, 1.0, 1.0]
    meta["frequency_penalty"][rows] = [1.5, 2.0, -0.5, 2.0, 2.0]
    meta["repetition_penalty"][rows] = [1.3, 0.8, 1.0, 2.0, 1.1]


def _sample_both(logits: np.ndarray, meta: dict[str, np.ndarray], specs: list[SampleSpec],
                 flags: StepFlags) -> tuple[tuple, tuple]:
    """(JAX's sample, torch's sample) of the same rows."""
    entries = build_logit_entries(specs, 256)
    flags = dataclasses.replace(flags, logit_entries=entries is not None)
    packed = ((entries.ints, entries.bias) if entries is not None
              else (np.full((4, 1), -1, np.int32), np.zeros(1, np.float32)))
    jax_sampling = {k: jnp.asarray(v) for k, v in meta.items()}
    jax_sampling["entries"] = tuple(map(jnp.asarray, packed))
    ref = jax.jit(jax_sampler.sample)(jnp.asarray(logits), jax_sampling,
                                      jnp.asarray(flags.as_array()) != 0)
    torch_sampling = {k: torch.from_numpy(v) for k, v in meta.items()}
    for name in ("rng_seed", "rng_step"):
        torch_sampling[name] = torch.from_numpy(meta[name].astype(np.int64))
    if entries is not None:
        n = entries.num_entries
        torch_sampling["entries"] = (torch.from_numpy(entries.ints[:, :n]),
                                     torch.from_numpy(entries.bias[:n]))
    got = torch_sampler.sample(torch.from_numpy(logits), torch_sampling, flags)
    return tuple(None if x is None else np.asarray(x) for x in ref), got


@pytest.mark.parametrize("seed,vocab", [(0, 512), (1, 1000), (2, 4099)])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("processors", [False, True])
def test_samplers_agree(seed: int, vocab: int, logprobs: bool, processors: bool) -> None:
    """processors: some rows also have penalties and logit_bias."""
    logits = np.random.default_rng(seed).normal(0, 3, (len(ROWS), vocab)).astype(np.float32)
    meta = _metadata(seed)
    if processors:
        _set_penalties(meta)
    flags = StepFlags(sampled=True, filters=True, logprobs=logprobs)
    ref, got = _sample_both(logits, meta, _specs(logits, processors, seed), flags)
    np.testing.assert_array_equal(got[0].numpy(), ref[0])
    np.testing.assert_allclose(got[1].numpy(), ref[1], rtol=0, atol=1e-5)
    assert got[0][0] != logits[0].argmax() and got[0][1] != logits[1].argmax()  # banned
    if processors:  # they matter: the plain sampler picks otherwise in most processed rows
        assert got[0][2] == 11  # logit_bias +100
        plain, _ = _sample_both(logits, _metadata(seed), _specs(logits, False, seed), flags)
        assert (plain[0] != got[0].numpy()).sum() >= 3
    if logprobs:
        np.testing.assert_array_equal(got[2].numpy(), ref[2])
        np.testing.assert_allclose(got[3].numpy(), ref[3], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got[4].numpy(), ref[4])  # ranks
        assert got[4].min() >= 1 and (got[4][0] > 1 or got[4][1] > 1)
        assert ref[2].shape == (len(ROWS), MAX_LOGPROBS)
    else:
        assert got[2] is None and got[4] is None and not ref[2].any()  # a branch not taken


@pytest.mark.parametrize("sampled,filters", [(False, False), (True, False)])
def test_samplers_agree_on_the_skipped_paths(sampled: bool, filters: bool) -> None:
    """The all-greedy and no-filter paths (the branches a step skips) match too."""
    logits = np.random.default_rng(7).normal(0, 3, (len(ROWS), 777)).astype(np.float32)
    meta = _metadata(7)
    if not sampled:
        meta["temperature"][:] = 0.0
    meta["top_k"][:], meta["top_p"][:], meta["min_p"][:] = 0, 1.0, 0.0
    ref, got = _sample_both(logits, meta, _specs(logits, False, 7),
                            StepFlags(sampled=sampled, filters=filters))
    np.testing.assert_array_equal(got[0].numpy(), ref[0])
    np.testing.assert_allclose(got[1].numpy(), ref[1], rtol=0, atol=1e-5)


def test_uniform_is_bit_exact() -> None:
    """Edge counters (0, 2**32 - 1) included: the int64 emulation of uint32 must not drift."""
    seeds = np.array([0, 1, 2**31, 2**32 - 1, 0x9E3779B9, 12345], np.uint32)
    steps = np.array([0, 2**32 - 1, 7, 2**31 + 5, 1, 99], np.uint32)
    expected = prng.uniform(seeds, steps, 70_000)
    got = torch_sampler.uniform(torch.from_numpy(seeds.astype(np.int64)),
                                torch.from_numpy(steps.astype(np.int64)), 70_000).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert 0.0 < got.min() and got.max() < 1.0


def test_uniforms_never_reach_one() -> None:
    """The extreme hashes give uniforms strictly inside (0, 1) on every implementation: a 1.0
    made a Gumbel noise of +inf, which sampled a uniformly random token (one in 2**24 draws)."""
    bits = np.array([[0, 1, 2**31, 2**32 - 2**9, 2**32 - 1]], np.uint32)
    for got in (prng.bits_to_uniform(bits),
                np.asarray(jax_sampler.bits_to_uniform(jnp.asarray(bits))),
                torch_sampler.bits_to_uniform(torch.from_numpy(bits.astype(np.int64))).numpy()):
        assert got.dtype == np.float32
        assert 0.0 < got.min() and got.max() < 1.0
        assert np.isfinite(-np.log(-np.log(got))).all()
        np.testing.assert_array_equal(got, prng.bits_to_uniform(bits))


def test_the_jax_argmax_is_jnps():
    """Two reductions instead of XLA's variadic argmax: the first index of the maximum, ties,
    -inf rows and NaN (the first NaN wins, as in jnp.argmax) included, on 2-D and 3-D logits."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(6, 3, 40)).astype(np.float32)  # many ties
    x[0, 0] = -np.inf
    x[1, 1, [5, 9]] = np.nan
    x[2, 2, 7] = np.inf
    for logits in (jnp.asarray(x), jnp.asarray(x[:, 0])):
        got = jax_sampler.argmax(logits)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, jnp.argmax(logits, axis=-1))


def test_filters_pass_padding_rows() -> None:
    """Padding rows carry zero knobs: top_p 0 keeps the largest logit alone (n >= 1) in the
    sorted filter (it gathered index -1: a device-side assert in every sampled CUDA graph) and in
    the C++ one (its quickselect never ended), and the request rows are filtered as before."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    top_k, top_p, min_p = torch.tensor([5, 0, 0]), torch.tensor([0.9, 0.0, 0.0]), torch.zeros(3)
    sorted_out = torch_sampler.filter_logits_sorted(logits, top_k, top_p, min_p)
    cpu_out = torch_sampler.filter_logits(logits, top_k, top_p, min_p)
    kept = torch.isfinite(sorted_out)
    assert torch.equal(kept, torch.isfinite(cpu_out))
    assert kept.sum(dim=-1).tolist()[1:] == [1, 1] and 1 <= int(kept[0].sum()) <= 5
    assert torch.equal(kept[1:].int().argmax(dim=-1), logits[1:].argmax(dim=-1))
