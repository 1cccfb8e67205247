"""The draft side of a speculative step, inside the runner's jitted step (no host round trip).

1. catch-up: one ragged draft pass over the tokens the draft has not computed, up to each
   sequence's last real token, whose logits give draft 1 (a mixed step, K = 0, stops here);
2. K - 1 single-token draft passes in a `lax.fori_loop`, each feeding the previous draft. K is
   the step's k (one executable per compiled k, step_shapes.py): the trip count is static, and
   a sequence that proposes fewer drafts writes nothing in the passes past them.

The draft writes its KV into its own cache at the target's slots (same block ids). Returns the
drafts and their sampling distributions q for rejection sampling (one-hot on greedy rows).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pagedjax import random as prng
from pagedjax.backends.jax.model import AttentionMetadata, KVCache
from pagedjax.backends.jax.rejection_sampler import sampling_probs
from pagedjax.backends.jax.sampler import _mix32, argmax, uniform
from pagedjax.core.batch import StepFlag
from pagedjax.core.step_shapes import BatchLayout

# (input_ids [T], kv_caches, metadata, logits_indices [L]) -> (logits [L, V], kv_caches)
DraftForward = Callable[[jax.Array, list[KVCache], AttentionMetadata, jax.Array],
                        tuple[jax.Array, list[KVCache]]]
_KNOBS = ("temperature", "top_k", "top_p", "min_p")


def catch_up_metadata(b: dict[str, jax.Array], rope: tuple[jax.Array, jax.Array]
                      ) -> AttentionMetadata:
    """The draft's catch-up pass over the tokens it has not computed."""
    return AttentionMetadata(b["draft_positions"], b["draft_slot_mapping"],
                             b["draft_query_start_loc"], b["draft_kv_lens"], b["block_tables"],
                             *rope)


def propose_drafts(forward: DraftForward, kv_caches: list[KVCache], b: dict[str, jax.Array],
                   sampling: dict[str, jax.Array], flags: jax.Array,
                   rope: tuple[jax.Array, jax.Array], *,
                   layout: BatchLayout) -> tuple[list[KVCache], jax.Array, jax.Array]:
    """Returns (draft KV caches, drafts [S, K] int32, q [S, K, V] float32); K >= 1.

    b: the step's unpacked fields (batch.py); sampling: the per-row knobs [L]; flags: the
    step's (batch.StepFlag).
    """
    num_seqs, k = layout.num_seqs, layout.num_spec_tokens
    rows = b["seq_sample_row"]  # [S]: each sequence samples its drafts with its row's knobs
    knobs = {name: sampling[name][rows] for name in _KNOBS}
    seeds = _mix32(sampling["rng_seed"][rows] ^ jnp.uint32(prng.DRAFT_STREAM))  # [S]
    steps = sampling["rng_step"][rows]  # [S]

    def sample(logits: jax.Array, j: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Draft j + 1 from logits [S, V]: (tokens [S], q [S, V]); a greedy row's q is
        one-hot, so its draft is its argmax either way."""
        q = sampling_probs(logits, knobs, flags)

        def random(q: jax.Array) -> jax.Array:
            u = uniform(seeds, steps + jnp.asarray(j, jnp.uint32), logits.shape[-1])
            return argmax(jnp.log(q) - jnp.log(-jnp.log(u)))

        return jax.lax.cond(flags[StepFlag.SAMPLED], random, argmax, q), q

    last_rows = jnp.maximum(b["draft_query_start_loc"][1:] - 1, 0)  # [S]
    logits, kv_caches = forward(b["draft_input_ids"], kv_caches, catch_up_metadata(b, rope),
                                last_rows)  # [S, V]
    first, q = sample(logits, 0)
    drafts = jnp.zeros((num_seqs, k), jnp.int32).at[:, 0].set(first)
    probs = jnp.zeros((num_seqs, k, q.shape[-1]), q.dtype).at[:, 0].set(q)
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
        return kv_caches, drafts.at[:, j].set(token), probs.at[:, j].set(q)

    return jax.lax.fori_loop(1, k, draft_step, (kv_caches, drafts, probs))
