"""On-device sampling for the JAX runner; semantics shared with the torch sampler.

Order (vLLM's): raw logprobs (returned) → banned tokens (min_tokens) → logit_bias → repetition,
frequency and presence penalties → the grammar's token bitmask (structured outputs) → greedy
rows take the argmax; random rows divide by
temperature, keep top-k, then top-p, then min-p, and take the argmax of logits + Gumbel noise
from pagedjax.rng's counters (an exact categorical sample).

The shapes never depend on what the rows ask for: each optional part is a `lax.cond` on the
step's flags (batch.StepFlag), a branch XLA runs or skips inside the compiled step; where the
flags are known when tracing (a NumPy array: the runner's branch-free decode steps, PLAIN with
every part off and FULL with every part on, a no-op for the rows that ask nothing) the part is
traced in or left out instead (`branch`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import rng as prng
from pagedjax.core.batch import StepFlag
from pagedjax.core.logit_entries import EntryFlag
from pagedjax.sampling_params import MAX_LOGPROBS


def branch(pred, true_fn: Callable, false_fn: Callable, *operands):
    """lax.cond(pred, true_fn, false_fn, *operands), or, where pred is a concrete bool (flags
    known when tracing), the one function it picks: no conditional in the program."""
    if isinstance(pred, (bool, np.bool_)):
        return (true_fn if pred else false_fn)(*operands)
    return jax.lax.cond(pred, true_fn, false_fn, *operands)


def cpu_kernels(x: jax.Array) -> bool:
    """Whether a trace over x uses the C++ CPU kernels (XLA's FFI): on a CPU, in float32."""
    from pagedjax.backends.jax import cpu_ffi

    return jax.default_backend() == "cpu" and x.dtype == jnp.float32 and cpu_ffi.available()


def _mix32(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(prng.MIX_MUL_1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(prng.MIX_MUL_2)
    return x ^ (x >> 16)


def uniform(seed: jax.Array, step: jax.Array, num: int) -> jax.Array:
    """[L] uint32 seeds and steps → [L, num] float32 uniforms in (0, 1) (see pagedjax.rng)."""
    key = _mix32(seed[:, None] ^ _mix32(step[:, None] * jnp.uint32(prng.GOLDEN)))
    bits = _mix32(key + jnp.arange(num, dtype=jnp.uint32)[None, :] * jnp.uint32(prng.STREAM))
    return bits_to_uniform(bits)


def bits_to_uniform(bits: jax.Array) -> jax.Array:
    """uint32 hashes → float32 uniforms strictly inside (0, 1) (pagedjax.rng's)."""
    top = (bits >> (32 - prng.UNIFORM_BITS)).astype(jnp.float32)
    return (top + 0.5) * (2.0**-prng.UNIFORM_BITS)


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
    from pagedjax.backends.jax import cpu_ffi

    if cpu_kernels(x):
        return cpu_ffi.top_k(x, k)
    return jax.lax.top_k(x, k)


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Mask to -inf what top-k, then top-p, then min-p drop. logits [L, V]; knobs [L]. On CPU in
    float32 the C++ filter (the sort-based version below took 70 ms for 64 rows of 4,096)."""
    from pagedjax.backends.jax import cpu_ffi

    if cpu_kernels(logits):
        return cpu_ffi.filter_logits(logits, top_k, top_p, min_p)
    return filter_logits_sorted(logits, top_k, top_p, min_p)


def filter_logits_sorted(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                         min_p: jax.Array) -> jax.Array:
    """filter_logits by sorting each row: the definition (filter_cpu_kernel.h states it)."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [L, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [L]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    keep = in_top_k & ((jnp.cumsum(probs, axis=-1) - probs < top_p[:, None])
                       | (top_p[:, None] >= 1.0))
    num_kept = jnp.sum(keep, axis=-1)  # [L] >= 1
    threshold = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]
    min_p_threshold = jnp.where(min_p > 0, sorted_desc[:, 0] + jnp.log(min_p), -jnp.inf)
    threshold = jnp.maximum(threshold, min_p_threshold)
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


def apply_logit_entries(logits: jax.Array, entries: tuple[jax.Array, jax.Array],
                        sampling: dict) -> jax.Array:
    """logits [R, V] with the (row, token) entries of logit_entries.py applied: banned tokens at
    -inf, logit_bias added, then repetition, frequency and presence penalties (vLLM's
    definitions), touching the E entries only. entries: (ints [4, E] = rows (-1 pads), tokens,
    output counts, flags; bias [E]); sampling: the penalty knobs [R]."""
    ints, bias = entries
    rows, tokens, counts, flags = ints[0], ints[1], ints[2], ints[3]
    num_rows = logits.shape[0]
    valid = rows >= 0
    safe_rows = jnp.where(valid, rows, 0)
    x = logits[safe_rows, tokens]  # [E]
    x = jnp.where(flags & EntryFlag.BANNED != 0, -jnp.inf, x)
    x = x + bias
    penalty = sampling["repetition_penalty"][safe_rows]
    x = jnp.where(flags & EntryFlag.SEEN != 0, jnp.where(x > 0, x / penalty, x * penalty), x)
    x = x - sampling["frequency_penalty"][safe_rows] * counts
    x = x - sampling["presence_penalty"][safe_rows] * (counts > 0)
    return logits.at[jnp.where(valid, rows, num_rows), tokens].set(x, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [R, V] at -inf where bitmask [R, ceil(V / 32)] int32 has the token's bit (t % 32
    of word t // 32) clear: what a row's grammar forbids."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]] != 0  # [R, V]
    return jnp.where(allowed, logits, -jnp.inf)


def process_logits(logits: jax.Array, sampling: dict, flags: jax.Array) -> jax.Array:
    """The logits [R, V] rows sample from: the logit entries, then the token bitmask applied,
    where the step has any (sampling["token_bitmask"] [R, W] may be left out: none)."""
    logits = branch(flags[StepFlag.LOGIT_ENTRIES],
                    lambda x: apply_logit_entries(x, sampling["entries"], sampling),
                    lambda x: x, logits)
    if "token_bitmask" not in sampling:
        return logits
    return branch(flags[StepFlag.TOKEN_MASK],
                  lambda x: apply_token_bitmask(x, sampling["token_bitmask"]),
                  lambda x: x, logits)


def logits_stats(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [L, V] → (argmax [L] int32, log-sum-exp [L]): the greedy token, and what turns
    any logit into its logprob (logprob = logit - lse), without writing out [L, V] logprobs. On
    CPU in float32 one C++ pass per row (logits_cpu_kernel.h; the torch backend's op too)."""
    from pagedjax.backends.jax import cpu_ffi

    if cpu_kernels(logits) and logits.ndim == 2:
        return cpu_ffi.logits_stats(logits)
    return argmax(logits), jax.nn.logsumexp(logits, axis=-1)


def sample(logits: jax.Array, sampling: dict, flags: jax.Array) -> tuple[jax.Array, ...]:
    """logits [L, V] float32 → token ids [L], then gather_logprobs' (logprobs [L], top ids
    [L, N], top logprobs [L, N], ranks [L]): a StepOutput's first five fields.

    flags [len(StepFlag)] bool: what the step's rows use; the rest is a branch not taken. A
    greedy step without logit entries or a token mask reads the logits once (logits_stats)."""
    raw_argmax, lse = logits_stats(logits)  # logprobs are the raw model's
    processed = flags[StepFlag.LOGIT_ENTRIES]
    if "token_bitmask" in sampling:
        processed = processed | flags[StepFlag.TOKEN_MASK]
    greedy = branch(processed, lambda x: argmax(process_logits(x, sampling, flags)),
                    lambda _: raw_argmax, logits)

    def random(logits: jax.Array) -> jax.Array:
        logits = process_logits(logits, sampling, flags)
        temperature = sampling["temperature"]
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = branch(flags[StepFlag.FILTERS], lambda x: filter_logits(
            x, sampling["top_k"], sampling["top_p"], sampling["min_p"]), lambda x: x, scaled)
        u = uniform(sampling["rng_seed"], sampling["rng_step"], logits.shape[-1])
        sampled = argmax(scaled - jnp.log(-jnp.log(u)))
        return jnp.where(temperature > 0, sampled, greedy)

    tokens = branch(flags[StepFlag.SAMPLED], random, lambda _: greedy, logits)
    return (tokens, *gather_logprobs(logits, lse, tokens, flags[StepFlag.LOGPROBS]))


def gather_logprobs(logits: jax.Array, lse: jax.Array, tokens: jax.Array,
                    with_top: jax.Array | bool) -> tuple[jax.Array, ...]:
    """logits [..., V] with their log-sum-exp [...], tokens [...] (-1 = none) → (token logprobs
    [...], top ids [..., N], top logprobs [..., N], ranks [...]) with N = MAX_LOGPROBS; the last
    three are zeros unless with_top (a branch not taken).

    A token's rank is the number of tokens at least as likely (vLLM's): 1 = the most likely."""
    safe = jnp.maximum(tokens, 0)[..., None]
    token_logits = jnp.take_along_axis(logits, safe, axis=-1)[..., 0]

    def top(logits: jax.Array) -> tuple[jax.Array, ...]:
        ranks = jnp.sum(logits >= token_logits[..., None], axis=-1, dtype=jnp.int32)
        top_logits, top_ids = _top_k(logits, MAX_LOGPROBS)
        return top_ids.astype(jnp.int32), top_logits - lse[..., None], ranks

    def none(logits: jax.Array) -> tuple[jax.Array, ...]:
        shape = (*logits.shape[:-1], MAX_LOGPROBS)
        return (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(logits.shape[:-1], jnp.int32))

    return (token_logits - lse, *branch(with_top, top, none, logits))


def score_prompt_tokens(logits: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, ...]:
    """prompt_logprobs: logits [Pl, V] at prompt positions, token_ids [Pl] the prompt token
    after each → gather_logprobs' four, with the top MAX_LOGPROBS."""
    return gather_logprobs(logits, jax.nn.logsumexp(logits, axis=-1), token_ids, True)
