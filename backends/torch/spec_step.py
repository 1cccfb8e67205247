"""The draft side of a speculative step on the torch runner: the semantics of
backends/jax/spec_step.py, op for op, with no host synchronisation (no shape depends on data).

1. catch-up: one ragged draft pass over the tokens the draft has not computed, up to each
   sequence's last real token, whose logits give draft 1 (a mixed step, K = 0, stops there);
2. K - 1 single-token draft passes, each feeding the previous draft (captured in the step's CUDA
   graph on GPU).

Drafts are the draft model's argmax (see the JAX version).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.torch.model import KVCache
from pagedjax.core.step_shapes import BatchLayout

# (input_ids [T], kv_caches, metadata, logits_indices [L]) -> logits [L, V] (caches written)
DraftForward = Callable[[torch.Tensor, list[KVCache], AttentionMetadata, torch.Tensor],
                        torch.Tensor]


def propose_drafts(forward: DraftForward, kv_caches: list[KVCache], b: dict[str, torch.Tensor],
                   rope: tuple[torch.Tensor, torch.Tensor], *, layout: BatchLayout,
                   max_query_len: int, num_tokens: int | None = None) -> torch.Tensor | None:
    """Returns drafts [S, K] int32, or None in a mixed step (K = 0: the catch-up only).

    b: the step's unpacked fields on the device; max_query_len: a host bound on the catch-up
    pass's longest query (the launch); num_tokens: the catch-up's real tokens, when only those
    run (None: T).
    """
    num_seqs, k = layout.num_seqs, layout.num_spec_tokens
    td = layout.num_tokens if num_tokens is None else max(num_tokens, 1)  # a row to read
    meta = AttentionMetadata(b["draft_positions"][:td], b["draft_slot_mapping"][:td],
                             b["draft_query_start_loc"], b["draft_kv_lens"], b["block_tables"],
                             *rope, max_query_len=max_query_len)
    last_rows = (b["draft_query_start_loc"][1:] - 1).clamp(min=0)  # [S]
    if not k:
        forward(b["draft_input_ids"][:td], kv_caches, meta, last_rows[:0])
        return None
    logits = forward(b["draft_input_ids"][:td], kv_caches, meta, last_rows)
    drafts = [torch.argmax(logits, dim=-1).to(torch.int32)]
    end = b["draft_kv_lens"]  # [S] position after the real tokens, for sequences that draft
    index = b["draft_token_index"].long().clamp(max=layout.num_tokens - 1)  # [S, K]
    slots = b["slot_mapping"][index]  # [S, K]: the target's slot of draft j, the draft's too
    seq_rows = torch.arange(num_seqs, device=end.device)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=end.device)
    for j in range(1, k):  # feed draft j (at position end + j - 1), propose draft j + 1
        # A sequence that drafts fewer than j + 1 tokens writes nothing and reads one key.
        active = j < b["num_drafts"]  # [S]
        positions = torch.where(active, end + j - 1, 0)
        step_meta = AttentionMetadata(
            positions, torch.where(active, slots[:, j - 1], -1), query_start_loc,
            positions + 1, b["block_tables"], *rope, max_query_len=1)
        logits = forward(drafts[-1], kv_caches, step_meta, seq_rows)
        drafts.append(torch.argmax(logits, dim=-1).to(torch.int32))
    return torch.stack(drafts, dim=1)
