"""The draft side of a speculative step on the torch runner: the semantics of
backends/jax/spec_step.py, op for op, with no host synchronisation (no shape depends on data).

1. catch-up: one ragged draft pass over the tokens the draft has not computed, up to each
   sequence's last real token, whose logits give draft 1 (a mixed step, K = 0, stops there);
2. K - 1 single-token draft passes, each feeding the previous draft (captured in the step's CUDA
   graph on GPU; on the CPU one C++ op runs them where the draft's stack is fused).

Drafts are the draft model's argmax (see the JAX version).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.torch.model import KVCache
from pagedjax.backends.torch.sampler import logits_stats
from pagedjax.core.step_shapes import BatchLayout

# (input_ids [T], kv_caches, metadata, logits_indices [L]) -> logits [L, V] (caches written)
DraftForward = Callable[[torch.Tensor, list[KVCache], AttentionMetadata, torch.Tensor],
                        torch.Tensor]
# (input_ids [S], positions [J, S], slot_mapping [J, S], block_tables) -> the J single-token
# steps' argmax [J, S] int32 and its logprobs in one op (DeviceModel.greedy_decode), or None
# where it has none
GreedyDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                        tuple[torch.Tensor, torch.Tensor] | None]


def propose_drafts(forward: DraftForward, kv_caches: list[KVCache], b: dict[str, torch.Tensor],
                   rope: tuple[torch.Tensor, torch.Tensor], *, layout: BatchLayout,
                   max_query_len: int, num_tokens: int | None = None,
                   greedy_decode: GreedyDecode | None = None) -> torch.Tensor | None:
    """Returns drafts [S, K] int32, or None in a mixed step (K = 0: the catch-up only).

    b: the step's unpacked fields on the device; max_query_len: a host bound on the catch-up
    pass's longest query (the launch); num_tokens: the catch-up's real tokens, when only those
    run (None: T); greedy_decode: the K - 1 passes in one op where the draft has it (the CPU's
    fused stack), else they run here, pass by pass.
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
    first = logits_stats(forward(b["draft_input_ids"][:td], kv_caches, meta, last_rows))[0]
    if k == 1:
        return first[:, None]
    # Pass j (1 .. K - 1) feeds draft j at position end + j - 1 and proposes draft j + 1; a
    # sequence that drafts fewer than j + 1 tokens writes nothing and reads one key.
    end = b["draft_kv_lens"]  # [S] position after the real tokens, for sequences that draft
    index = b["draft_token_index"][:, :-1].long().clamp(max=layout.num_tokens - 1)  # [S, K-1]
    j = torch.arange(1, k, dtype=end.dtype, device=end.device)[:, None]  # [K-1, 1]
    active = j < b["num_drafts"]  # [K-1, S]
    positions = torch.where(active, end + j - 1, 0)  # [K-1, S]
    # the target's slot of draft j, the draft's too
    slots = torch.where(active, b["slot_mapping"][index.T], -1)  # [K-1, S]
    decoded = None if greedy_decode is None else greedy_decode(first, positions, slots,
                                                               b["block_tables"])
    if decoded is None:
        seq_rows = torch.arange(num_seqs, device=end.device)
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=end.device)
        drafts = [first]
        for step_positions, step_slots in zip(positions, slots):
            step_meta = AttentionMetadata(step_positions, step_slots, query_start_loc,
                                          step_positions + 1, b["block_tables"], *rope,
                                          max_query_len=1)
            drafts.append(logits_stats(forward(drafts[-1], kv_caches, step_meta, seq_rows))[0])
        return torch.stack(drafts, dim=1)
    return torch.cat([first[:, None], decoded[0].T], dim=1)
