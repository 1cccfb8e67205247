"""The draft side of a speculative step, inside the runner's jitted step (no host round trip).

1. catch-up: one ragged draft pass over the tokens the draft has not computed, up to each
   sequence's last real token, whose logits give draft 1;
2. k - 1 single-token draft passes in a `lax.fori_loop`, each feeding the previous draft. The
   layout's K is the engine's maximum; a step that chose a smaller k runs only its k - 1 passes
   (CPU) or masks the rest (GPU), so choosing k never recompiles.

The draft writes its KV into its own cache at the target's slots (same block ids). Returns the
drafts and, unless every row is greedy, their sampling distributions q for rejection sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pagedjax import random as prng
from pagedjax.backends.jax.model import AttentionMetadata, KVCache
from pagedjax.backends.jax.rejection_sampler import sampling_probs
from pagedjax.backends.jax.sampler import _mix32, argmax, uniform
from pagedjax.core.batch import BatchLayout

# (input_ids [T], kv_caches, metadata, logits_indices [L]) -> (logits [L, V], kv_caches)
DraftForward = Callable[[jax.Array, list[KVCache], AttentionMetadata, jax.Array],
                        tuple[jax.Array, list[KVCache]]]
_KNOBS = ("temperature", "top_k", "top_p", "min_p")


def propose_drafts(forward: DraftForward, kv_caches: list[KVCache], b: dict[str, jax.Array],
                   sampling: dict[str, jax.Array], rope: tuple[jax.Array, jax.Array], *,
                   layout: BatchLayout) -> tuple[list[KVCache], jax.Array, jax.Array | None]:
    """Returns (draft KV caches, drafts [S, K] int32, q [S, K, V] float32 or None if greedy).

    b: the step's unpacked fields (BatchLayout); sampling: the per-row knobs [L].
    """
    num_seqs, k = layout.num_seqs, layout.num_spec_tokens
    rows = b["seq_sample_row"]  # [S]: each sequence samples its drafts with its row's knobs
    knobs = {name: sampling[name][rows] for name in _KNOBS}
    seeds = _mix32(sampling["rng_seed"][rows] ^ jnp.uint32(prng.DRAFT_STREAM))  # [S]
    steps = sampling["rng_step"][rows]  # [S]

    def sample(logits: jax.Array, j: int | jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Draft j + 1 from logits [S, V]: (tokens [S], q [S, V] or None)."""
        if layout.all_greedy:
            return argmax(logits), None
        q = sampling_probs(logits, knobs, all_greedy=False, use_filters=layout.use_filters)
        u = uniform(seeds, steps + jnp.asarray(j, jnp.uint32), logits.shape[-1])
        tokens = argmax(jnp.log(q) - jnp.log(-jnp.log(u)))
        return tokens, q

    meta = AttentionMetadata(b["draft_positions"], b["draft_slot_mapping"],
                             b["draft_query_start_loc"], b["draft_kv_lens"], b["block_tables"],
                             *rope)
    last_rows = jnp.maximum(b["draft_query_start_loc"][1:] - 1, 0)  # [S]
    logits, kv_caches = forward(b["draft_input_ids"], kv_caches, meta, last_rows)  # [S, V]
    first, q = sample(logits, 0)
    drafts = jnp.zeros((num_seqs, k), jnp.int32).at[:, 0].set(first)
    probs = None if q is None else jnp.zeros((num_seqs, k, q.shape[-1]), q.dtype).at[:, 0].set(q)
    if k == 1:
        return kv_caches, drafts, probs

    end = b["draft_kv_lens"]  # [S] position after the real tokens, for sequences that draft
    index = jnp.clip(b["draft_token_index"], 0, layout.num_tokens - 1)  # [S, K]
    slots = b["slot_mapping"][index]  # [S, K]: the target's slot of draft j, the draft's too
    seq_rows = jnp.arange(num_seqs, dtype=jnp.int32)

    def draft_step(j: jax.Array, carry: tuple) -> tuple:
        """Feed draft j (at position end + j - 1) and sample draft j + 1."""
        kv_caches, drafts, probs = carry
        # A sequence that drafts fewer than j + 1 tokens writes nothing and reads one key.
        active = j < b["num_drafts"]  # [S]
        positions = jnp.where(active, end + j - 1, 0)
        query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
        step_meta = AttentionMetadata(positions, jnp.where(active, slots[:, j - 1], -1),
                                      query_start_loc, positions + 1, b["block_tables"], *rope,
                                      decode=True)
        logits, kv_caches = forward(drafts[:, j - 1], kv_caches, step_meta, seq_rows)
        token, q = sample(logits, j)
        drafts = drafts.at[:, j].set(token)
        if probs is not None:
            probs = probs.at[:, j].set(q)
        return kv_caches, drafts, probs

    step_k = jnp.max(b["num_drafts"])  # this step's k (<= K): later passes propose nothing
    skip = jax.default_backend() == "cpu"

    def body(j: jax.Array, carry: tuple) -> tuple:
        # On CPU a conditional is free, so passes past the step's k are skipped; on a GPU it
        # would wait for the host to read its predicate, so they run masked instead.
        if skip:
            return jax.lax.cond(j < step_k, draft_step, lambda j, carry: carry, j, carry)
        return draft_step(j, carry)

    return jax.lax.fori_loop(1, k, body, (kv_caches, drafts, probs))
