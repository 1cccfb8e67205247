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


def shift_ahead(b: dict[str, jax.Array], last: jax.Array, *, layout: BatchLayout,
                block_size: int) -> dict[str, jax.Array]:
    """A draft model's speculative step launched before the last one's tokens reached the host
    (async speculation, Scheduler.schedule_next): the host built it as though every sequence
    had accepted none of its drafts. Each sequence whose first row reads its token on the
    device (input_rows) moves here by the drafts the last step accepted for it, a: its target
    rows' positions, slots and KV length, and its random counter; and the draft catches up on
    the token at its new end, after the last draft where all were accepted (the draft never fed
    that one). b: the step's unpacked fields, moved fields replaced (a new dict). last [3, R]
    (carry()'s): each last logits row's last token, the one before it where all its drafts
    were accepted (-1 otherwise), and its drafts accepted."""
    s, t = layout.num_seqs, layout.num_tokens
    b = dict(b)
    token = jnp.arange(t, dtype=jnp.int32)
    query_start_loc = b["query_start_loc"]  # [S + 1]
    row = b["input_rows"][jnp.minimum(query_start_loc[:-1], t - 1)]  # [S]: 1 + last row, or 0
    ahead = (row > 0) & (query_start_loc[1:] > query_start_loc[:-1])
    src = jnp.maximum(row - 1, 0)
    shift = jnp.where(ahead, last[2][src], 0)  # [S]
    before = jnp.where(ahead, last[1][src], -1)  # [S]
    tables = b["block_tables"]

    def slots(seq: jax.Array, positions: jax.Array) -> jax.Array:
        return tables[seq, positions // block_size] * block_size + positions % block_size

    # (compare_all: no while loop, whose predicate a GPU would send to the host every pass)
    seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right",
                                       method="compare_all"), s - 1)
    moved = (token < query_start_loc[s]) & ahead[seq]
    b["positions"] = b["positions"] + jnp.where(moved, shift[seq], 0)
    b["slot_mapping"] = jnp.where(moved, slots(seq, b["positions"]), b["slot_mapping"])
    b["kv_lens"] = b["kv_lens"] + shift
    b["rng_step"] = b["rng_step"] + shift[b["sample_seq"]]  # uint32 bits: wraps alike

    # The draft's catch-up: 1 token a moved sequence (its new end), 2 where all were accepted.
    host_start = b["draft_query_start_loc"]  # [S + 1]
    lens = jnp.where(ahead, 1 + (before >= 0), host_start[1:] - host_start[:-1])  # [S]
    start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens, dtype=jnp.int32)])
    dseq = jnp.minimum(jnp.searchsorted(start[1:], token, side="right", method="compare_all"),
                       s - 1)  # [T]
    j = token - start[dseq]
    real = token < start[s]
    dmoved = real & ahead[dseq]
    kept = real & ~ahead[dseq]
    old = jnp.clip(host_start[dseq] + j, 0, t - 1)  # the host's row of a sequence not moved
    end = b["draft_kv_lens"] + shift  # [S] after the catch-up: the sequence's new end
    positions = end[dseq] - lens[dseq] + j
    fed = jnp.where(j == lens[dseq] - 1, last[0][src[dseq]], before[dseq])
    b["draft_input_ids"] = jnp.where(dmoved, fed, jnp.where(kept, b["draft_input_ids"][old], 0))
    b["draft_positions"] = jnp.where(dmoved, positions,
                                     jnp.where(kept, b["draft_positions"][old], 0))
    b["draft_slot_mapping"] = jnp.where(dmoved, slots(dseq, positions),
                                        jnp.where(kept, b["draft_slot_mapping"][old], -1))
    b["draft_query_start_loc"] = start
    b["draft_kv_lens"] = end
    return b


def carry(tokens: jax.Array, num_draft_tokens: jax.Array, num_rows: int) -> jax.Array:
    """What the next step reads on the device of this one's tokens [L, K+1] (-1 padded;
    num_draft_tokens [L]: the drafts each row verified): [3, R] (R = num_rows), each row's
    last token, the one before it where every draft was accepted (else -1), and the drafts
    accepted; rows past L: zeros (and -1)."""
    rows = min(num_rows, tokens.shape[0])
    if tokens.shape[1] == 1:  # no drafts (a plain step): its one token, none accepted
        return (jnp.zeros((3, num_rows), jnp.int32).at[1].set(-1)
                .at[0, :rows].set(tokens[:rows, 0]))
    count = (tokens >= 0).sum(axis=1, dtype=jnp.int32)  # [L]
    accepted = jnp.maximum(count - 1, 0)
    lines = jnp.arange(tokens.shape[0])
    last = tokens[lines, accepted]
    all_kept = (accepted == num_draft_tokens) & (accepted > 0)
    before = jnp.where(all_kept, tokens[lines, jnp.maximum(accepted - 1, 0)], -1)
    out = jnp.zeros((3, num_rows), jnp.int32).at[1].set(-1)
    return out.at[:, :rows].set(jnp.stack([last, before, accepted])[:, :rows])
