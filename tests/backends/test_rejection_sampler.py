"""The batched rejection samplers (JAX and torch) against hand-built greedy cases, the batch-1
NumPy oracle (tests/support/spec_oracle.py) fed the same uniforms, each other, and the target
distribution itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax import rng as prng
from pagedjax.backends.jax import rejection_sampler as jax_rs
from pagedjax.backends.jax import sampler as jax_sampler
from pagedjax.backends.torch import rejection_sampler as torch_rs
from pagedjax.backends.torch import sampler as torch_sampler
from pagedjax.core.batch import StepFlags
from pagedjax.core.logit_entries import EntryFlag
from tests.support.spec_oracle import speculative_step_reference

KNOBS = ("temperature", "top_k", "top_p", "min_p")
# One row per knob mix (temperature, top_k, top_p, min_p); temperature 0 = greedy.
ROWS = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.5, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.9, 10, 0.9, 0.02),
    (0.0, 5, 0.5, 0.0),  # greedy ignores the filters
]
_jax_rejection_sample = jax.jit(jax_rs.rejection_sample)
_jax_sampling_probs = jax.jit(jax_rs.sampling_probs)
_jax_sample = jax.jit(jax_sampler.sample)


def _with_entries(meta: dict) -> tuple[dict, tuple[np.ndarray, np.ndarray] | None]:
    """meta's banned (row, token) pairs, if any, as the step's logit entries (BANNED; row -1
    pads), and the penalty knobs those need at their neutral values."""
    meta = {"repetition_penalty": np.ones_like(meta["temperature"]),
            "frequency_penalty": np.zeros_like(meta["temperature"]),
            "presence_penalty": np.zeros_like(meta["temperature"]), **meta}
    rows, tokens = meta.pop("banned_rows", None), meta.pop("banned_token_ids", None)
    if rows is None:
        return meta, None
    flags = np.where(rows >= 0, int(EntryFlag.BANNED), 0)
    ints = np.stack([rows, tokens, np.zeros_like(rows), flags]).astype(np.int32)
    return meta, (ints, np.zeros(len(rows), np.float32))


def _jax_inputs(meta: dict, all_greedy: bool, use_filters: bool) -> tuple[dict, jax.Array]:
    """The JAX samplers' sampling dict (with its logit entries) and step flags."""
    meta, entries = _with_entries(meta)
    sampling = {k: jnp.asarray(v) for k, v in meta.items()}
    empty = (np.full((4, 1), -1, np.int32), np.zeros(1, np.float32))
    sampling["entries"] = tuple(map(jnp.asarray, entries or empty))
    flags = StepFlags(sampled=not all_greedy, filters=use_filters,
                      logit_entries=entries is not None)
    return sampling, jnp.asarray(flags.as_array()) != 0


class JaxBackend:
    name = "jax"

    def sampling_probs(self, logits: np.ndarray, meta: dict, **flags: bool) -> np.ndarray:
        return np.asarray(_jax_sampling_probs(jnp.asarray(logits), *_jax_inputs(meta, **flags)))

    def rejection_sample(self, target_logits: np.ndarray, draft_token_ids: np.ndarray,
                         draft_probs: np.ndarray | None, num_draft_tokens: np.ndarray,
                         meta: dict, **flags: bool) -> tuple[np.ndarray, np.ndarray]:
        args = (target_logits, draft_token_ids, draft_probs, num_draft_tokens)
        out = _jax_rejection_sample(*(None if a is None else jnp.asarray(a) for a in args),
                                    *_jax_inputs(meta, **flags))
        return np.asarray(out[0]), np.asarray(out[1])

    def sample(self, logits: np.ndarray, meta: dict, **flags: bool) -> np.ndarray:
        return np.asarray(_jax_sample(jnp.asarray(logits), *_jax_inputs(meta, **flags))[0])


class TorchBackend:
    name = "torch"

    def sampling_probs(self, logits: np.ndarray, meta: dict, **flags: bool) -> np.ndarray:
        return torch_rs.sampling_probs(torch.from_numpy(logits), _torch(meta), **flags).numpy()

    def rejection_sample(self, target_logits: np.ndarray, draft_token_ids: np.ndarray,
                         draft_probs: np.ndarray | None, num_draft_tokens: np.ndarray,
                         meta: dict, **flags: bool) -> tuple[np.ndarray, np.ndarray]:
        args = (target_logits, draft_token_ids, draft_probs, num_draft_tokens)
        out = torch_rs.rejection_sample(*(None if a is None else torch.from_numpy(a)
                                          for a in args), _torch(meta), **flags)
        return out[0].numpy(), out[1].numpy()

    def sample(self, logits: np.ndarray, meta: dict, all_greedy: bool,
               use_filters: bool) -> np.ndarray:
        flags = StepFlags(sampled=not all_greedy, filters=use_filters)
        return torch_sampler.sample(torch.from_numpy(logits), _torch(meta), flags)[0].numpy()


def _torch(meta: dict) -> dict[str, torch.Tensor]:
    """The torch sampler's convention: rng counters as int64 tensors holding uint32 values;
    banned pairs as its logit entries."""
    meta, entries = _with_entries(meta)
    counters = ("rng_seed", "rng_step")
    out = {k: torch.from_numpy(v.astype(np.int64) if k in counters else v)
           for k, v in meta.items()}
    if entries is not None:
        out["entries"] = tuple(map(torch.from_numpy, entries))
    return out


BACKENDS = [JaxBackend(), TorchBackend()]
RANDOM = dict(all_greedy=False, use_filters=True)


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request):
    return request.param


def _meta(rows: list[tuple], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """[L] sampling arrays for the given knob rows; random seeds, steps near the uint32 wrap."""
    temperature, top_k, top_p, min_p = (np.array(c) for c in zip(*rows))
    num_rows = len(rows)
    return {
        "temperature": temperature.astype(np.float32), "top_k": top_k.astype(np.int32),
        "top_p": top_p.astype(np.float32), "min_p": min_p.astype(np.float32),
        "rng_seed": rng.integers(0, 2**32, num_rows, dtype=np.uint32),
        "rng_step": (2**32 - rng.integers(1, 8, num_rows)).astype(np.uint32),
    }


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _per_position(meta: dict, num_positions: int) -> dict[str, np.ndarray]:
    return {k: np.repeat(meta[k], num_positions) for k in KNOBS}


# ---------------------------------------------------------------------------- greedy, by hand


def _greedy_case() -> tuple[np.ndarray, ...]:
    """K = 3, V = 8; argmax per position is known, draft_probs are noise the rule ignores."""
    num_drafts, vocab = 3, 8
    argmax = np.array([[1, 2, 3, 4], [5, 6, 7, 0], [2, 2, 2, 2], [3, 1, 4, 1], [7, 0, 7, 0]])
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 0.1, (len(argmax), num_drafts + 1, vocab)).astype(np.float32)
    np.put_along_axis(logits, argmax[..., None], 5.0, axis=-1)
    drafts = np.array([
        [1, 2, 3],  # all accepted → bonus argmax[3]
        [5, 0, 7],  # mismatch at j = 1 → recovered 6
        [-1, -1, -1],  # empty draft → bonus argmax[0]
        [3, 1, -1],  # ragged k = 2, all accepted → bonus argmax[2]
        [0, 0, 7],  # mismatch at j = 0 → recovered 7
    ], np.int32)
    num_draft_tokens = np.array([3, 3, 0, 2, 3], np.int32)
    draft_probs = _softmax(rng.normal(0, 1, (len(argmax), num_drafts, vocab)))
    return logits, drafts, draft_probs, num_draft_tokens


@pytest.mark.parametrize("all_greedy", [True, False], ids=["all_greedy", "mixed_path"])
def test_greedy_is_greedy_decoding(backend, all_greedy: bool) -> None:
    logits, drafts, draft_probs, num_draft_tokens = _greedy_case()
    meta = _meta([(0.0, 3, 0.5, 0.1)] * len(drafts), np.random.default_rng(1))
    out, num_accepted = backend.rejection_sample(logits, drafts, draft_probs, num_draft_tokens,
                                                 meta, all_greedy=all_greedy, use_filters=True)
    expected = np.array([
        [1, 2, 3, 4],
        [5, 6, -1, -1],
        [2, -1, -1, -1],
        [3, 1, 4, -1],
        [7, -1, -1, -1],
    ], np.int32)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(num_accepted, [3, 1, 0, 2, 0])
    assert out.dtype == np.int32 and num_accepted.dtype == np.int32


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_cpu_op_is_the_torch_rule(seed: int) -> None:
    """Greedy rows without logit entries on the CPU: `pagedjax::rejection_greedy_sample` over
    the logits' argmax (logits_stats', handed in as raw_argmax) is the torch ops' rule: ragged
    and empty drafts, padding drafts (-1), runs of matches of every length."""
    rng = np.random.default_rng(seed)
    num_rows, num_drafts, vocab = 64, 5, 6  # a small vocabulary: drafts often match
    logits = torch.from_numpy(rng.normal(size=(num_rows, num_drafts + 1, vocab)).astype(
        np.float32))
    argmax = logits.argmax(-1).int()  # [L, K+1]
    drafts = torch.where(torch.from_numpy(rng.random((num_rows, num_drafts)) < 0.7),
                         argmax[:, :-1], torch.from_numpy(rng.integers(-1, vocab, (
                             num_rows, num_drafts)).astype(np.int32)))
    num_draft_tokens = torch.from_numpy(rng.integers(0, num_drafts + 1, num_rows).astype(
        np.int32))
    meta = _torch(_meta([(0.0, 0, 1.0, 0.0)] * num_rows, rng))
    greedy = dict(all_greedy=True, use_filters=False)
    expected = torch_rs.rejection_sample(logits, drafts, None, num_draft_tokens, meta, **greedy)
    op = torch_rs.rejection_sample(logits, drafts, None, num_draft_tokens, meta, **greedy,
                                   raw_argmax=argmax)
    for x, y in zip(op, expected, strict=True):
        assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y)
    assert len(set(expected[1].tolist())) == num_drafts + 1  # every count of accepted drafts


# ------------------------------------------------------------------------- random, vs oracle


def _random_case(seed: int, num_rows: int = 32, num_drafts: int = 4,
                 vocab: int = 50) -> tuple[np.ndarray, ...]:
    """Mixed greedy / random / filtered rows. q is near p, unrelated, or one-hot (a greedy
    draft); drafts are drawn from q except on every fifth row (tokens q may give 0 mass)."""
    rng = np.random.default_rng(seed)
    meta = _meta([ROWS[i % len(ROWS)] for i in range(num_rows)], rng)
    logits = rng.normal(0, 2, (num_rows, num_drafts + 1, vocab)).astype(np.float32)
    noise = rng.normal(0, 1, (num_rows, num_drafts, vocab)) * rng.choice([0.3, 3.0], num_rows)[
        :, None, None]
    draft_probs = _softmax(logits[:, :num_drafts] + noise)
    one_hot = np.arange(num_rows) % 3 == 2
    draft_probs[one_hot] = np.eye(vocab, dtype=np.float32)[draft_probs[one_hot].argmax(-1)]
    with np.errstate(divide="ignore"):
        gumbel = -np.log(-np.log(rng.uniform(size=draft_probs.shape)))
        drafts = np.argmax(np.log(draft_probs) + gumbel, axis=-1).astype(np.int32)
    drafts[::5] = rng.integers(0, vocab, drafts[::5].shape)
    num_draft_tokens = rng.integers(0, num_drafts + 1, num_rows).astype(np.int32)
    past = np.arange(num_drafts)[None, :] >= num_draft_tokens[:, None]
    drafts[past] = -1
    draft_probs[past] = np.nan  # never read
    return logits, drafts, draft_probs, num_draft_tokens, meta


def _oracle(target_probs: np.ndarray, drafts: np.ndarray, draft_probs: np.ndarray,
            num_draft_tokens: np.ndarray, meta: dict) -> np.ndarray:
    """speculative_step_reference row by row with the counters' uniforms → [L, K+1]."""
    num_rows, num_positions, vocab = target_probs.shape
    out = np.full((num_rows, num_positions), -1, np.int32)
    for row in range(num_rows):
        k = num_draft_tokens[row]
        steps = (meta["rng_step"][row].astype(np.uint64) + np.arange(k + 1)) % 2**32
        u = prng.uniform(np.full(k + 1, meta["rng_seed"][row]), steps.astype(np.uint32), vocab + 1)
        tokens = speculative_step_reference(target_probs[row, :k + 1], drafts[row, :k],
                                            draft_probs[row, :k], u[:k, vocab], u[:, :vocab])
        out[row, :len(tokens)] = tokens
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_batch1_oracle(backend, seed: int) -> None:
    logits, drafts, draft_probs, num_draft_tokens, meta = _random_case(seed)
    num_rows, num_positions, vocab = logits.shape
    target_probs = backend.sampling_probs(logits.reshape(-1, vocab),
                                          _per_position(meta, num_positions), **RANDOM)
    expected = _oracle(target_probs.reshape(logits.shape), drafts, draft_probs,
                       num_draft_tokens, meta)
    out, num_accepted = backend.rejection_sample(logits, drafts, draft_probs, num_draft_tokens,
                                                 meta, **RANDOM)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(num_accepted, (expected >= 0).sum(axis=1) - 1)
    rejected = num_accepted < num_draft_tokens
    assert rejected.any() and (~rejected & (num_draft_tokens > 0)).any()  # both outcomes seen


def test_residual_falls_back_to_target(backend) -> None:
    """q == p and a draft outside p's support: rejected, and the all-zero residual draws from p."""
    rng = np.random.default_rng(3)
    meta = _meta([(1.0, 3, 1.0, 0.0)] * 64, rng)
    logits = np.tile(rng.normal(0, 1, (1, 2, 20)).astype(np.float32), (64, 1, 1))
    probs = backend.sampling_probs(logits.reshape(-1, 20), _per_position(meta, 2), **RANDOM)
    draft_probs = probs.reshape(64, 2, 20)[:, :1].copy()
    outside = np.argsort(logits[0, 0])[:1]  # the smallest logit: not in the top 3
    drafts = np.full((64, 1), outside[0], np.int32)
    out, num_accepted = backend.rejection_sample(logits, drafts, draft_probs,
                                                 np.ones(64, np.int32), meta, **RANDOM)
    top3 = set(np.argsort(logits[0, 0])[-3:])
    assert (num_accepted == 0).all() and set(out[:, 0]) == top3 and (out[:, 1] == -1).all()


# --------------------------------------------------------------------- determinism, parity


def test_seeded_determinism(backend) -> None:
    logits, drafts, draft_probs, num_draft_tokens, meta = _random_case(4, num_rows=64)
    args = (logits, drafts, draft_probs, num_draft_tokens)
    first = backend.rejection_sample(*args, meta, **RANDOM)
    again = backend.rejection_sample(*args, meta, **RANDOM)
    reseeded = backend.rejection_sample(*args, {**meta, "rng_seed": meta["rng_seed"] + 1},
                                        **RANDOM)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    random_rows = meta["temperature"] > 0
    assert (first[0][random_rows] != reseeded[0][random_rows]).any()
    greedy_rows = ~random_rows
    np.testing.assert_array_equal(first[0][greedy_rows], reseeded[0][greedy_rows])


@pytest.mark.parametrize("all_greedy,use_filters", [(False, True), (False, False), (True, False)])
def test_backends_agree(all_greedy: bool, use_filters: bool) -> None:
    logits, drafts, draft_probs, num_draft_tokens, meta = _random_case(5, num_rows=64)
    if all_greedy:
        meta["temperature"][:] = 0.0
    meta["banned_rows"] = np.array([0, 1, 3, -1], np.int32)  # rows 0, 1 may draft, unlike
    meta["banned_token_ids"] = np.array([7, 9, 11, 0], np.int32)  # the scheduler's min_tokens
    args = (logits, drafts, draft_probs, num_draft_tokens, meta)
    flags = dict(all_greedy=all_greedy, use_filters=use_filters)
    jax_out, torch_out = (b.rejection_sample(*args, **flags) for b in BACKENDS)
    np.testing.assert_array_equal(jax_out[0], torch_out[0])
    np.testing.assert_array_equal(jax_out[1], torch_out[1])


def test_empty_draft_samples_like_the_sampler(backend) -> None:
    """With k = 0 the bonus token is what the plain sampler samples from the same counters,
    banned tokens (min_tokens) included: ban every row's argmax, -1 rows pad."""
    rng = np.random.default_rng(6)
    meta = _meta([ROWS[i % len(ROWS)] for i in range(64)], rng)
    logits = rng.normal(0, 2, (64, 1, 300)).astype(np.float32)
    meta["banned_rows"] = np.array([*range(64), -1, -1], np.int32)
    meta["banned_token_ids"] = np.array([*logits[:, 0].argmax(-1), 0, 1], np.int32)
    out, _ = backend.rejection_sample(logits, np.zeros((64, 0), np.int32),
                                      np.zeros((64, 0, 300), np.float32),
                                      np.zeros(64, np.int32), meta, **RANDOM)
    tokens = backend.sample(logits[:, 0], meta, **RANDOM)
    np.testing.assert_array_equal(out[:, 0], tokens)
    assert (out[:, 0] != logits[:, 0].argmax(-1)).all()


# --------------------------------------------------------------------------- distribution


def test_output_follows_the_target_distribution(backend) -> None:
    """100k rows, V = 10, K = 2, drafts drawn from q: each output position is distributed as p_j
    (given the drafts before it were accepted), whatever q proposes."""
    num_rows, vocab, temperature, top_k = 100_000, 10, 0.8, 8
    rng = np.random.default_rng(7)
    target = rng.normal(0, 1, (3, vocab)).astype(np.float32)  # fixed logits per position
    q = _softmax(target[:2] + rng.normal(0, 0.3, (2, vocab)))
    q[0, np.argsort(target[0])[-2]] = 0.0  # never proposed: only a recovered token can emit it
    q /= q.sum(axis=-1, keepdims=True)
    q64 = q.astype(np.float64) / q.astype(np.float64).sum(axis=-1, keepdims=True)
    drafts = np.stack([rng.choice(vocab, num_rows, p=q64[j]) for j in range(2)], axis=1)
    meta = _meta([(temperature, top_k, 1.0, 0.0)] * num_rows, rng)
    meta["rng_seed"] = np.arange(num_rows, dtype=np.uint32)
    out, num_accepted = backend.rejection_sample(
        np.broadcast_to(target, (num_rows, 3, vocab)).copy(), drafts.astype(np.int32),
        np.broadcast_to(q, (num_rows, 2, vocab)).copy(), np.full(num_rows, 2, np.int32), meta,
        **RANDOM)
    scaled = target / temperature
    kth = np.sort(scaled, axis=-1)[:, -top_k][:, None]
    p = _softmax(np.where(scaled >= kth, scaled, -np.inf))  # [3, V], computed independently
    for j in range(3):
        tokens = out[num_accepted >= j, j]
        empirical = np.bincount(tokens, minlength=vocab) / len(tokens)
        assert 0.5 * np.abs(empirical - p[j]).sum() <= 0.01, (j, empirical, p[j])
    accept_rate = np.mean(num_accepted >= 1)
    assert abs(accept_rate - np.minimum(p[0], q[0]).sum()) <= 0.01


def test_greedy_drafts_keep_the_target_distribution(backend) -> None:
    """Drafts that are the draft model's argmax (draft_probs None: q one-hot, as the engines
    propose): each output position is still distributed as p_j, and a draft is accepted with
    probability p_j(d_j)."""
    num_rows, vocab, temperature = 100_000, 10, 0.8
    rng = np.random.default_rng(11)
    target = rng.normal(0, 1, (3, vocab)).astype(np.float32)
    drafts = np.tile(np.argsort(target[:2], axis=-1)[:, -2], (num_rows, 1))  # second best
    meta = _meta([(temperature, 0, 1.0, 0.0)] * num_rows, rng)
    meta["rng_seed"] = np.arange(num_rows, dtype=np.uint32)
    out, num_accepted = backend.rejection_sample(
        np.broadcast_to(target, (num_rows, 3, vocab)).copy(), drafts.astype(np.int32), None,
        np.full(num_rows, 2, np.int32), meta, **RANDOM)
    p = _softmax(target / temperature)
    for j in range(3):
        tokens = out[num_accepted >= j, j]
        empirical = np.bincount(tokens, minlength=vocab) / len(tokens)
        # 1.5 times the summed standard errors: j = 2 has only p(d_0) p(d_1) of the rows
        tolerance = 1.5 * np.sqrt(p[j] * (1 - p[j]) / len(tokens)).sum()
        assert np.abs(empirical - p[j]).sum() <= tolerance, (j, empirical, p[j])
    assert abs(np.mean(num_accepted >= 1) - p[0, drafts[0, 0]]) <= 0.01


# --------------------------------------------------------------------------- sampling_probs


def test_sampling_probs(backend) -> None:
    rng = np.random.default_rng(8)
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.5, 0, 1.0, 0.2),
            (1.3, 0, 1.0, 0.0)]
    meta = _meta(rows, rng)
    logits = rng.normal(0, 2, (len(rows), 100)).astype(np.float32)
    probs = backend.sampling_probs(logits, meta, **RANDOM)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(probs[0], np.eye(100)[logits[0].argmax()])  # greedy: one-hot
    assert set(np.flatnonzero(probs[1])) == set(np.argsort(logits[1])[-5:])  # top-k
    order = np.argsort(-logits[2])
    full = _softmax(logits[2])[order]
    num_kept = int(np.sum(np.cumsum(full) - full < 0.6))  # the smallest prefix with mass >= 0.6
    assert set(np.flatnonzero(probs[2])) == set(order[:num_kept])  # top-p
    tempered = _softmax(logits[3] / 0.5)
    assert set(np.flatnonzero(probs[3])) == set(np.flatnonzero(tempered >= 0.2 * tempered.max()))
    np.testing.assert_allclose(probs[4], _softmax(logits[4] / 1.3), rtol=1e-5, atol=1e-7)
    greedy = backend.sampling_probs(logits, meta, all_greedy=True, use_filters=False)
    np.testing.assert_array_equal(greedy, np.eye(100, dtype=np.float32)[logits.argmax(-1)])
