"""The draft side of a speculative step, inside the runner's jitted step (no host round trip).

1. catch-up: one ragged draft pass over the tokens the draft has not computed, up to each
   sequence's last real token, whose logits give draft 1 (a mixed step, K = 0, stops here);
2. K - 1 single-token draft passes in a `lax.fori_loop` (unrolled on accelerators), each feeding
   the previous draft. K is
   the step's k (one executable per compiled k, step_shapes.py): the trip count is static, and
   a sequence that proposes fewer drafts writes nothing in the passes past them.

Drafts are the draft model's argmax, as vLLM's proposers draft: rejection sampling keeps the
target's distribution exactly for any proposal, a greedy one included (its q is one-hot), and a
speculative step then compiles one sampler, the verifier's. The draft writes its KV into its
own cache at the target's slots (same block ids).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.jax.model import KVCache
from pagedjax.backends.jax.sampler import argmax
from pagedjax.core.step_shapes import BatchLayout

# (input_ids [T], kv_caches, metadata, logits_indices [L]) -> (logits [L, V], kv_caches)
DraftForward = Callable[[jax.Array, list[KVCache], AttentionMetadata, jax.Array],
                        tuple[jax.Array, list[KVCache]]]


def catch_up_metadata(b: dict[str, jax.Array], rope: tuple[jax.Array, jax.Array]
                      ) -> AttentionMetadata:
    """The draft's catch-up pass over the tokens it has not computed."""
    return AttentionMetadata(b["draft_positions"], b["draft_slot_mapping"],
                             b["draft_query_start_loc"], b["draft_kv_lens"], b["block_tables"],
                             *rope)


def propose_drafts(forward: DraftForward, kv_caches: list[KVCache], b: dict[str, jax.Array],
                   rope: tuple[jax.Array, jax.Array], *,
                   layout: BatchLayout, unroll: bool = False) -> tuple[list[KVCache], jax.Array]:
    """Returns (draft KV caches, drafts [S, K] int32); K >= 1. b: the step's unpacked fields
    (batch.py). unroll: the K - 1 passes traced one after the other (the runner's branch-free
    steps), not as a loop."""
    num_seqs, k = layout.num_seqs, layout.num_spec_tokens
    last_rows = jnp.maximum(b["draft_query_start_loc"][1:] - 1, 0)  # [S]
    logits, kv_caches = forward(b["draft_input_ids"], kv_caches, catch_up_metadata(b, rope),
                                last_rows)  # [S, V]
    drafts = jnp.zeros((num_seqs, k), jnp.int32).at[:, 0].set(argmax(logits))
    if k == 1:
        return kv_caches, drafts

    end = b["draft_kv_lens"]  # [S] position after the real tokens, for sequences that draft
    index = jnp.clip(b["draft_token_index"], 0, layout.num_tokens - 1)  # [S, K]
    slots = b["slot_mapping"][index]  # [S, K]: the target's slot of draft j, the draft's too
    seq_rows = jnp.arange(num_seqs, dtype=jnp.int32)

    def draft_step(j: jax.Array, carry: tuple) -> tuple:
        """Feed draft j (at position end + j - 1) and propose draft j + 1."""
        kv_caches, drafts = carry
        # A sequence that drafts fewer than j + 1 tokens writes nothing and reads one key.
        active = j < b["num_drafts"]  # [S]
        positions = jnp.where(active, end + j - 1, 0)
        query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
        step_meta = AttentionMetadata(positions, jnp.where(active, slots[:, j - 1], -1),
                                      query_start_loc, positions + 1, b["block_tables"], *rope,
                                      decode=True)
        logits, kv_caches = forward(drafts[:, j - 1], kv_caches, step_meta, seq_rows)
        return kv_caches, drafts.at[:, j].set(argmax(logits))

    carry = (kv_caches, drafts)
    if unroll:  # no while loop (on a GPU its predicate goes to the host every pass); a scan's
        for j in range(1, k):  # unroll=True keeps one (jax 0.10)
            carry = draft_step(j, carry)
        return carry
    return jax.lax.fori_loop(1, k, draft_step, carry)
