"""On-device sampling for the JAX runner; semantics shared with the torch sampler.

Order (vLLM's): raw logprobs (returned) → banned tokens (min_tokens) → logit_bias → repetition,
frequency and presence penalties → greedy rows take the argmax; random rows divide by
temperature, keep top-k, then top-p, then min-p, and take the argmax of logits + Gumbel noise
from pagedjax.random's counters (an exact categorical sample).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax import random as prng
from pagedjax.sampling_params import MAX_LOGPROBS


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


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis as int32 (the first index of the maximum; a NaN counts as
    the maximum), in two plain reductions: XLA's CPU argmax, a variadic reduce, took ~4x as long
    as the max and min over a [64, 4096] batch of logits."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k; on CPU in float32 the C++ one (XLA's CPU TopK sorts each row: ~9x as slow
    for 20 of 4096)."""
    from pagedjax.kernels_pallas import cpu_ffi

    if jax.default_backend() == "cpu" and x.dtype == jnp.float32 and cpu_ffi.available():
        return cpu_ffi.top_k(x, k)
    return jax.lax.top_k(x, k)


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


def _row_counts(sampling: dict, num_rows: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """The penalties' (row, token, count) triples [Q] → output token counts [L, V] int32 and
    seen-in-prompt-or-output [L, V] bool (row -1 pads: dropped)."""
    rows = jnp.where(sampling["penalty_rows"] >= 0, sampling["penalty_rows"], num_rows)
    tokens = sampling["penalty_token_ids"]
    counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, tokens].add(
        sampling["penalty_counts"], mode="drop")
    seen = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, tokens].set(True, mode="drop")
    return counts, seen


def process_logits(logits: jax.Array, sampling: dict) -> jax.Array:
    """The logits [L, V] rows sample from: banned tokens at -inf, logit_bias added, then
    repetition, frequency and presence penalties (vLLM's definitions). Inputs the layout lacks
    are skipped."""
    num_rows, vocab = logits.shape
    if "banned_rows" in sampling:
        rows = jnp.where(sampling["banned_rows"] >= 0, sampling["banned_rows"], num_rows)
        logits = logits.at[rows, sampling["banned_token_ids"]].set(-jnp.inf, mode="drop")
    if "bias_rows" in sampling:
        rows = jnp.where(sampling["bias_rows"] >= 0, sampling["bias_rows"], num_rows)
        logits = logits + jnp.zeros((num_rows, vocab), jnp.float32).at[
            rows, sampling["bias_token_ids"]].add(sampling["logit_bias"], mode="drop")
    if "penalty_rows" in sampling:
        counts, seen = _row_counts(sampling, num_rows, vocab)  # [L, V]
        # [L, V], not a broadcast: XLA would turn a division by a broadcast into an inexact
        # multiplication by its reciprocal.
        penalty = jnp.where(seen, sampling["repetition_penalty"][:, None], 1.0)
        logits = jnp.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits - sampling["frequency_penalty"][:, None] * counts
        logits = logits - sampling["presence_penalty"][:, None] * (counts > 0)
    return logits


def sample(logits: jax.Array, sampling: dict, *, num_top_logprobs: int, all_greedy: bool,
           use_filters: bool) -> tuple[jax.Array | None, ...]:
    """logits [L, V] float32 → token ids [L], then gather_logprobs' (logprobs [L], top ids
    [L, N], top logprobs [L, N], ranks [L]): a StepOutput's first five fields."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = process_logits(logits, sampling)
    tokens = argmax(logits)
    if not all_greedy:
        temperature = sampling["temperature"]
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        if use_filters:
            scaled = filter_logits(scaled, sampling["top_k"], sampling["top_p"], sampling["min_p"])
        u = uniform(sampling["rng_seed"], sampling["rng_step"], logits.shape[-1])
        sampled = argmax(scaled - jnp.log(-jnp.log(u)))
        tokens = jnp.where(temperature > 0, sampled, tokens)
    return (tokens, *gather_logprobs(logprobs, tokens, num_top_logprobs))


def gather_logprobs(logprobs: jax.Array, tokens: jax.Array,
                    num_top_logprobs: int) -> tuple[jax.Array | None, ...]:
    """logprobs [..., V], tokens [...] (-1 = none) → (token logprobs [...], top ids [..., N],
    top logprobs [..., N], ranks [...]); all but the first are None when N is 0.

    A token's rank is the number of tokens at least as likely (vLLM's): 1 = the most likely."""
    safe = jnp.maximum(tokens, 0)[..., None]
    token_logprobs = jnp.take_along_axis(logprobs, safe, axis=-1)[..., 0]
    if num_top_logprobs == 0:
        return token_logprobs, None, None, None
    ranks = jnp.sum(logprobs >= token_logprobs[..., None], axis=-1, dtype=jnp.int32)
    top_lps, top_ids = _top_k(logprobs, num_top_logprobs)
    return token_logprobs, top_ids.astype(jnp.int32), top_lps, ranks


def score_prompt_tokens(logits: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, ...]:
    """prompt_logprobs: logits [Pl, V] at prompt positions, token_ids [Pl] the prompt token
    after each → gather_logprobs' four, with the top MAX_LOGPROBS."""
    return gather_logprobs(jax.nn.log_softmax(logits, axis=-1), token_ids, MAX_LOGPROBS)
