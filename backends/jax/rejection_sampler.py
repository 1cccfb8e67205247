"""Rejection sampling for speculative decoding (Leviathan et al. 2023) on the JAX runner.

Vocabulary (vLLM's), per row l with k = num_draft_tokens[l] drafts d_0 ... d_{k-1}:
- accepted: a draft d_j kept because u_j * q_j(d_j) < p_j(d_j), i.e. u_j < min(1, p/q);
- recovered: at the first rejection j, a token drawn from normalize(max(p_j - q_j, 0));
- bonus: when all k drafts are accepted, a token drawn from p_k.
A row outputs its accepted drafts, then one recovered or bonus token, then -1 padding; the tokens
follow the target distribution exactly, and greedy rows (temperature 0) decode greedily.

Randomness is the sampler's counter hash: output position t of a row uses
uniform(seed, step + t, V + 1), column V for the acceptance test and columns :V for the Gumbel
noise of a recovered / bonus token, so the caller advances rng_step by num_accepted + 1.
Semantics are shared op for op with backends/torch/rejection_sampler.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.backends.jax.sampler import (
    argmax,
    branch,
    filter_logits,
    process_logits,
    uniform,
)
from pagedjax.core.batch import StepFlag

PLACEHOLDER_TOKEN_ID = -1  # pads output_token_ids after the recovered / bonus token


def sampling_probs(logits: jax.Array, sampling: dict, flags: jax.Array) -> jax.Array:
    """The distribution the sampler draws from (the draft returns it as q).

    logits [L, V] float32; sampling: [L] arrays (temperature, top_k, top_p, min_p); flags: the
    step's (batch.StepFlag). Returns probs [L, V] float32: one-hot(argmax) on greedy rows,
    softmax(filter_logits(logits / T)) on random rows.
    """
    greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)

    def random(logits: jax.Array) -> jax.Array:
        temperature = sampling["temperature"]  # [L]
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = branch(flags[StepFlag.FILTERS], lambda x: filter_logits(
            x, sampling["top_k"], sampling["top_p"], sampling["min_p"]), lambda x: x, scaled)
        return jnp.where(temperature[:, None] > 0, jax.nn.softmax(scaled, axis=-1), greedy)

    return branch(flags[StepFlag.SAMPLED], random, lambda _: greedy, logits)


def rejection_sample(target_logits: jax.Array, draft_token_ids: jax.Array,
                     draft_probs: jax.Array | None, num_draft_tokens: jax.Array, sampling: dict,
                     flags: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Verify each row's drafts against the target; jit-compatible (K, V static from shapes).

    target_logits    [L, K+1, V] float32: position j scores draft j; j = k is the bonus position
    draft_token_ids  [L, K] int32, valid for j < num_draft_tokens[l] (anything, e.g. -1, after)
    draft_probs      [L, K, V] float32: q_j, the draft's sampling distribution for draft j;
                     None: the drafts are the draft model's argmax (q_j one-hot at d_j)
    num_draft_tokens [L] int32 in [0, K]
    sampling         [L] arrays as in the sampler; its logit entries (banned tokens, logit_bias
                     and penalties) apply at every position of their row (such rows have no
                     drafts: the scheduler does not draft for them); its token bitmask [L, W]
                     at position 0 only (structured outputs: the host checks the tokens after
                     it, structured_output/manager.py)
    flags            the step's (batch.StepFlag): a step of greedy rows skips the random path
    Returns output_token_ids [L, K+1] int32 (accepted, then recovered or bonus, then -1) and
    num_accepted [L] int32.
    """
    num_drafts = draft_token_ids.shape[1]  # K
    num_rows, num_positions, vocab = target_logits.shape
    positions = _per_position(sampling, num_positions)  # [L * (K+1)] rows
    target_logits = process_logits(target_logits.reshape(-1, vocab), positions, flags).reshape(
        num_rows, num_positions, vocab)
    target_argmax = argmax(target_logits)  # [L, K+1]
    greedy_accepted = target_argmax[:, :num_drafts] == draft_token_ids  # [L, K]
    valid = jnp.arange(num_drafts)[None, :] < num_draft_tokens[:, None]  # [L, K]

    def count(accepted: jax.Array) -> jax.Array:
        return jnp.sum(jnp.cumprod((accepted & valid).astype(jnp.int32), axis=1), axis=1)

    def greedy(_: jax.Array) -> tuple[jax.Array, jax.Array]:
        num_accepted = count(greedy_accepted)
        return num_accepted, jnp.take_along_axis(target_argmax, num_accepted[:, None],
                                                 axis=1)[:, 0]

    def random(target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        target_probs = _target_probs(target_logits, positions, flags)
        random_rows = (sampling["temperature"] > 0)[:, None]  # [L, 1]
        num_accepted = count(jnp.where(random_rows, _accept_random(
            target_probs, draft_token_ids, draft_probs, sampling), greedy_accepted))
        next_token = jnp.take_along_axis(target_argmax, num_accepted[:, None], axis=1)[:, 0]
        sampled = _recover_or_bonus(target_probs, draft_token_ids, draft_probs, num_accepted,
                                    num_draft_tokens, sampling)
        return num_accepted, jnp.where(random_rows[:, 0], sampled, next_token)

    num_accepted, next_token = branch(flags[StepFlag.SAMPLED], random, greedy, target_logits)
    return _assemble(draft_token_ids, next_token, num_accepted), num_accepted.astype(jnp.int32)


def _per_position(sampling: dict, num_positions: int) -> dict:
    """The sampling inputs of rows [L] for rows [L * (K+1)], position j of row l being row
    l * (K+1) + j: per-row knobs repeated, each logit entry once per position, the token
    bitmask at position 0 (every token allowed after it)."""
    out = {name: jnp.repeat(x, num_positions) for name, x in sampling.items()
           if name not in ("entries", "rng_seed", "rng_step", "token_bitmask")}
    if "token_bitmask" in sampling:
        bitmask = sampling["token_bitmask"]  # [L, W]
        first = (jnp.arange(num_positions) == 0)[None, :, None]  # [1, K+1, 1]
        out["token_bitmask"] = jnp.where(first, bitmask[:, None, :], -1).reshape(
            -1, bitmask.shape[-1])
    ints, bias = sampling["entries"]  # [4, E], [E]
    rows = ints[0][:, None] * num_positions + jnp.arange(num_positions, dtype=ints.dtype)
    rows = jnp.where(ints[0][:, None] >= 0, rows, -1).reshape(-1)  # [E * (K+1)]
    rest = jnp.repeat(ints[1:], num_positions, axis=1)  # [3, E * (K+1)]
    out["entries"] = (jnp.concatenate([rows[None], rest]), jnp.repeat(bias, num_positions))
    return out


def _target_probs(target_logits: jax.Array, positions: dict, flags: jax.Array) -> jax.Array:
    """p_j for every position: target_logits [L, K+1, V] → [L, K+1, V], as the sampler sees it.
    positions: the knobs per position (_per_position)."""
    num_rows, num_positions, vocab = target_logits.shape
    probs = sampling_probs(target_logits.reshape(-1, vocab), positions, flags)
    return probs.reshape(num_rows, num_positions, vocab)


def _accept_random(target_probs: jax.Array, draft_token_ids: jax.Array,
                   draft_probs: jax.Array | None, sampling: dict) -> jax.Array:
    """u_j * q_j(d_j) < p_j(d_j) → [L, K] bool (safe for q = 0); u_j = column V at step + j.

    target_probs [L, K+1, V]; draft_token_ids [L, K]; draft_probs [L, K, V] or None (one-hot).
    """
    num_rows, num_drafts = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    steps = sampling["rng_step"].astype(jnp.uint32)[:, None] + jnp.arange(num_drafts,
                                                                          dtype=jnp.uint32)
    seeds = jnp.broadcast_to(sampling["rng_seed"].astype(jnp.uint32)[:, None], steps.shape)
    u = uniform(seeds.reshape(-1), steps.reshape(-1), vocab + 1)[:, vocab]  # [L * K]
    index = jnp.clip(draft_token_ids, 0, vocab - 1)[..., None]  # padding drafts gather safely
    p = jnp.take_along_axis(target_probs[:, :num_drafts], index, axis=-1)[..., 0]  # [L, K]
    q = 1.0 if draft_probs is None else jnp.take_along_axis(draft_probs, index, axis=-1)[..., 0]
    return u.reshape(num_rows, num_drafts) * q < p


def _recover_or_bonus(target_probs: jax.Array, draft_token_ids: jax.Array,
                      draft_probs: jax.Array | None, num_accepted: jax.Array,
                      num_draft_tokens: jax.Array, sampling: dict) -> jax.Array:
    """The token after the accepted drafts, at position n = num_accepted → [L] int32.

    Recovered ~ max(p_n - q_n, 0) after a rejection (p_n if that is all zero); bonus ~ p_n
    (q_n taken as 0). target_probs [L, K+1, V]; draft_token_ids [L, K]; draft_probs [L, K, V]
    or None (one-hot at the drafts); the rest [L].
    """
    num_drafts, vocab = draft_token_ids.shape[1], target_probs.shape[-1]
    p = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]  # [L, V]
    q = jnp.zeros_like(p)
    if num_drafts > 0:
        position = jnp.minimum(num_accepted, num_drafts - 1)[:, None]  # [L, 1]
        rejected = (num_accepted < num_draft_tokens)[:, None]  # [L, 1]
        if draft_probs is None:
            draft = jnp.take_along_axis(draft_token_ids, position, axis=1)[:, 0]
            q_n = jax.nn.one_hot(draft, vocab, dtype=p.dtype)
        else:
            q_n = jnp.take_along_axis(draft_probs, position[:, :, None], axis=1)[:, 0]
        q = jnp.where(rejected, q_n, q)
    residual = jnp.maximum(p - q, 0.0)  # [L, V]
    residual = jnp.where(jnp.any(residual > 0, axis=-1, keepdims=True), residual, p)
    step = sampling["rng_step"].astype(jnp.uint32) + num_accepted.astype(jnp.uint32)
    u = uniform(sampling["rng_seed"].astype(jnp.uint32), step, vocab + 1)[:, :vocab]
    return argmax(jnp.log(residual) - jnp.log(-jnp.log(u)))


def _assemble(draft_token_ids: jax.Array, next_token: jax.Array,
              num_accepted: jax.Array) -> jax.Array:
    """[L, K] drafts, [L] next token, [L] counts → [L, K+1]: accepted, next token, then -1."""
    position = jnp.arange(draft_token_ids.shape[1] + 1)[None, :]  # [1, K+1]
    drafts = jnp.pad(draft_token_ids, ((0, 0), (0, 1)), constant_values=PLACEHOLDER_TOKEN_ID)
    n = num_accepted[:, None]
    tail = jnp.where(position == n, next_token[:, None], PLACEHOLDER_TOKEN_ID)
    return jnp.where(position < n, drafts, tail).astype(jnp.int32)
