"""On-device sampling for the JAX runner; semantics shared with the torch sampler.

Order: raw logprobs (returned) → banned tokens (min_tokens) → greedy rows take the argmax;
random rows divide by temperature, keep top-k, then top-p, then min-p, and take the argmax of
logits + Gumbel noise from pagedjax.random's counters (an exact categorical sample).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax import random as prng


def _mix32(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(prng.MIX_MUL_1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(prng.MIX_MUL_2)
    return x ^ (x >> 16)


def uniform(seed: jax.Array, step: jax.Array, num: int) -> jax.Array:
    """[L] uint32 seeds and steps → [L, num] float32 uniforms in (0, 1) (see pagedjax.random)."""
    key = _mix32(seed[:, None] ^ _mix32(step[:, None] * jnp.uint32(prng.GOLDEN)))
    bits = _mix32(key + jnp.arange(num, dtype=jnp.uint32)[None, :] * jnp.uint32(prng.STREAM))
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (2.0**-24)


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Mask to -inf what top-k, then top-p, then min-p drop. logits [L, V]; knobs [L]."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [L, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [L]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    keep = in_top_k & (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None])
    num_kept = jnp.sum(keep, axis=-1)  # [L] >= 1
    threshold = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]
    min_p_threshold = jnp.where(min_p > 0, sorted_desc[:, 0] + jnp.log(min_p), -jnp.inf)
    threshold = jnp.maximum(threshold, min_p_threshold)
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


def sample(logits: jax.Array, sampling: dict, *, num_top_logprobs: int, all_greedy: bool,
           use_filters: bool) -> tuple[jax.Array, ...]:
    """logits [L, V] float32 → token ids [L], logprobs [L], top ids [L, K], top logprobs [L, K]."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    rows = jnp.where(sampling["banned_rows"] >= 0, sampling["banned_rows"], logits.shape[0])
    logits = logits.at[rows, sampling["banned_token_ids"]].set(-jnp.inf, mode="drop")
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not all_greedy:
        temperature = sampling["temperature"]
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        if use_filters:
            scaled = filter_logits(scaled, sampling["top_k"], sampling["top_p"], sampling["min_p"])
        u = uniform(sampling["rng_seed"], sampling["rng_step"], logits.shape[-1])
        sampled = jnp.argmax(scaled - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)
        tokens = jnp.where(temperature > 0, sampled, tokens)
    return (tokens, *gather_logprobs(logprobs, tokens, num_top_logprobs))


def gather_logprobs(logprobs: jax.Array, tokens: jax.Array,
                    num_top_logprobs: int) -> tuple[jax.Array, ...]:
    """logprobs [..., V], tokens [...] (-1 = none) → (token logprobs [...], top ids [..., N],
    top logprobs [..., N]); the top ones are None when N is 0."""
    safe = jnp.maximum(tokens, 0)[..., None]
    token_logprobs = jnp.take_along_axis(logprobs, safe, axis=-1)[..., 0]
    if num_top_logprobs == 0:
        return token_logprobs, None, None
    top_lps, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
    return token_logprobs, top_ids.astype(jnp.int32), top_lps
