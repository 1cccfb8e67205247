"""The torch sampler must sample exactly what the JAX sampler samples, knob for knob."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax import random as prng
from pagedjax.backends.jax import sampler as jax_sampler
from pagedjax.backends.torch import sampler as torch_sampler
from pagedjax.sampling_params import MAX_LOGPROBS

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


def _metadata(seed: int, vocab: int, logits: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    num_rows = len(ROWS)
    temperature, top_k, top_p, min_p = (np.array(c) for c in zip(*ROWS))
    # Ban the argmax of a greedy row and of a random row (plus a few others); -1 rows pad.
    banned = [(0, int(logits[0].argmax())), (1, int(logits[1].argmax())), (0, 3), (5, 7)]
    rows, ids = (list(c) for c in zip(*banned))
    rows += [-1, -1, -1, -1]
    ids += [0, 1, 2, 3]
    return {
        "temperature": temperature.astype(np.float32), "top_k": top_k.astype(np.int32),
        "top_p": top_p.astype(np.float32), "min_p": min_p.astype(np.float32),
        "rng_seed": rng.integers(0, 2**32, num_rows, dtype=np.uint32),
        "rng_step": rng.integers(0, 2**32, num_rows, dtype=np.uint32),
        "banned_rows": np.array(rows, np.int32), "banned_token_ids": np.array(ids, np.int32),
    }


def _processor_metadata(seed: int, vocab: int, logits: np.ndarray) -> dict[str, np.ndarray]:
    """Penalties on rows 1, 3, 5, 9 and 11 (counting each row's likeliest tokens) and logit_bias
    on rows 0, 2 and 9, packed as build_model_input packs them; -1 rows pad."""
    rng = np.random.default_rng(seed + 100)
    num_rows = len(ROWS)
    top = np.argsort(-logits, axis=-1)[:, :3]  # [L, 3]
    rows, tokens, counts = [], [], []
    for r in (1, 3, 5, 9, 11):
        prompt = [int(top[r, 1]), *rng.integers(0, vocab, 6).tolist()]  # count 0: prompt
        output = [int(top[r, 0])] * 2 + [int(top[r, 2])]  # count 1 per occurrence
        rows += [r] * (len(prompt) + len(output))
        tokens += prompt + output
        counts += [0] * len(prompt) + [1] * len(output)
    bias = [(0, int(top[0, 0]), -100.0), (0, 4, 3.0), (2, 11, 100.0), (9, int(top[9, 1]), 2.5)]
    penalties = np.zeros((3, num_rows), np.float32)
    penalties[2] = 1.0  # repetition 1: off
    penalties[:, [1, 3, 5, 9, 11]] = [[2.0, -1.0, 2.0, 1.0, 1.0], [1.5, 2.0, -0.5, 2.0, 2.0],
                                      [1.3, 0.8, 1.0, 2.0, 1.1]]
    pad = [-1, -1, -1]
    return {
        "penalty_rows": np.array(rows + pad, np.int32),
        "penalty_token_ids": np.array(tokens + [0, 0, 0], np.int32),
        "penalty_counts": np.array(counts + [1, 1, 1], np.int32),
        "presence_penalty": penalties[0], "frequency_penalty": penalties[1],
        "repetition_penalty": penalties[2],
        "bias_rows": np.array([r for r, _, _ in bias] + pad, np.int32),
        "bias_token_ids": np.array([t for _, t, _ in bias] + [0, 0, 0], np.int32),
        "logit_bias": np.array([b for _, _, b in bias] + [0.0, 0.0, 0.0], np.float32),
    }


def _torch_sampling(meta: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(v) for k, v in meta.items()}
    out["rng_seed"] = torch.from_numpy(meta["rng_seed"].astype(np.int64))
    out["rng_step"] = torch.from_numpy(meta["rng_step"].astype(np.int64))
    return out


@pytest.mark.parametrize("seed,vocab", [(0, 512), (1, 1000), (2, 4099)])
@pytest.mark.parametrize("num_top_logprobs", [0, MAX_LOGPROBS])
@pytest.mark.parametrize("processors", [False, True])
def test_samplers_agree(seed: int, vocab: int, num_top_logprobs: int, processors: bool) -> None:
    """processors: some rows also have penalties and logit_bias."""
    logits = np.random.default_rng(seed).normal(0, 3, (len(ROWS), vocab)).astype(np.float32)
    meta = _metadata(seed, vocab, logits)
    if processors:
        meta.update(_processor_metadata(seed, vocab, logits))
    flags = dict(num_top_logprobs=num_top_logprobs, all_greedy=False, use_filters=True)
    ref = jax_sampler.sample(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in meta.items()},
                             **flags)
    got = torch_sampler.sample(torch.from_numpy(logits), _torch_sampling(meta), **flags)
    np.testing.assert_array_equal(got[0].numpy(), np.asarray(ref[0]))
    np.testing.assert_allclose(got[1].numpy(), np.asarray(ref[1]), rtol=0, atol=1e-5)
    assert got[0][0] != logits[0].argmax() and got[0][1] != logits[1].argmax()  # banned
    if processors:  # they matter: the plain sampler picks otherwise in most processed rows
        assert got[0][2] == 11  # logit_bias +100
        plain = jax_sampler.sample(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in
                                                         _metadata(seed, vocab, logits).items()},
                                   **flags)
        assert (np.asarray(plain[0]) != got[0].numpy()).sum() >= 3
    if num_top_logprobs:
        np.testing.assert_array_equal(got[2].numpy(), np.asarray(ref[2]))
        np.testing.assert_allclose(got[3].numpy(), np.asarray(ref[3]), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got[4].numpy(), np.asarray(ref[4]))  # ranks
        assert got[4].min() >= 1 and (got[4][0] > 1 or got[4][1] > 1)
    else:
        assert got[2] is None and ref[2] is None and got[4] is None and ref[4] is None


@pytest.mark.parametrize("all_greedy,use_filters", [(True, False), (False, False)])
def test_samplers_agree_static_paths(all_greedy: bool, use_filters: bool) -> None:
    """The all-greedy and no-filter fast paths match too (filters off in every row)."""
    logits = np.random.default_rng(7).normal(0, 3, (len(ROWS), 777)).astype(np.float32)
    meta = _metadata(7, 777, logits)
    if all_greedy:
        meta["temperature"][:] = 0.0
    meta["top_k"][:], meta["top_p"][:], meta["min_p"][:] = 0, 1.0, 0.0
    flags = dict(num_top_logprobs=0, all_greedy=all_greedy, use_filters=use_filters)
    ref = jax_sampler.sample(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in meta.items()},
                             **flags)
    got = torch_sampler.sample(torch.from_numpy(logits), _torch_sampling(meta), **flags)
    np.testing.assert_array_equal(got[0].numpy(), np.asarray(ref[0]))
    np.testing.assert_allclose(got[1].numpy(), np.asarray(ref[1]), rtol=0, atol=1e-5)


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
