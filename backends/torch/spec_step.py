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


def shift_ahead(b: dict[str, torch.Tensor], last: torch.Tensor, *, layout: BatchLayout,
                block_size: int) -> dict[str, torch.Tensor]:
    """A draft model's speculative step launched before the last one's tokens reached the host
    (async speculation): backends/jax/spec_step.shift_ahead, op for op (no shape depends on
    data). last [3, R]: each last logits row's last token, the one before it where all its
    drafts were accepted (-1 otherwise), and its drafts accepted. Returns b with the moved
    fields replaced (a new dict)."""
    s, t = layout.num_seqs, layout.num_tokens
    b = dict(b)
    device = last.device
    token = torch.arange(t, dtype=torch.int32, device=device)
    query_start_loc = b["query_start_loc"]  # [S + 1]
    row = b["input_rows"][query_start_loc[:-1].clamp(max=t - 1).long()]  # [S]
    ahead = (row > 0) & (query_start_loc[1:] > query_start_loc[:-1])
    src = (row - 1).clamp(min=0).long()
    shift = torch.where(ahead, last[2][src], 0)  # [S]
    before = torch.where(ahead, last[1][src], -1)  # [S]
    tables = b["block_tables"]

    def slots(seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (tables[seq, (positions // block_size).long()] * block_size
                + positions % block_size)

    seq = torch.searchsorted(query_start_loc[1:], token, right=True).clamp(max=s - 1)  # [T]
    moved = (token < query_start_loc[s]) & ahead[seq]
    positions = b["positions"] + torch.where(moved, shift[seq], 0)
    b["positions"] = positions
    b["slot_mapping"] = torch.where(moved, slots(seq, positions), b["slot_mapping"])
    b["kv_lens"] = b["kv_lens"] + shift
    b["rng_step"] = b["rng_step"] + shift[b["sample_seq"].long()]

    host_start = b["draft_query_start_loc"]  # [S + 1]
    lens = torch.where(ahead, 1 + (before >= 0).to(torch.int32), host_start[1:] - host_start[:-1])
    start = torch.cat([host_start[:1] * 0, torch.cumsum(lens, 0, dtype=torch.int32)])
    dseq = torch.searchsorted(start[1:], token, right=True).clamp(max=s - 1)  # [T]
    j = token - start[dseq]
    real = token < start[s]
    dmoved = real & ahead[dseq]
    kept = real & ~ahead[dseq]
    old = (host_start[dseq] + j).clamp(0, t - 1).long()
    end = b["draft_kv_lens"] + shift  # [S]
    draft_positions = end[dseq] - lens[dseq] + j
    fed = torch.where(j == lens[dseq] - 1, last[0][src[dseq]], before[dseq])
    zero = torch.zeros_like(token)
    b["draft_input_ids"] = torch.where(dmoved, fed,
                                       torch.where(kept, b["draft_input_ids"][old], zero))
    b["draft_positions"] = torch.where(dmoved, draft_positions,
                                       torch.where(kept, b["draft_positions"][old], zero))
    b["draft_slot_mapping"] = torch.where(
        dmoved, slots(dseq, draft_positions),
        torch.where(kept, b["draft_slot_mapping"][old], zero - 1))
    b["draft_query_start_loc"] = start
    b["draft_kv_lens"] = end
    return b


def keep_carry(last: torch.Tensor, tokens: torch.Tensor, num_draft_tokens: torch.Tensor | None
               ) -> None:
    """Write into last [3, R] what the next step reads of this one's tokens [L, K+1] (-1
    padded; num_draft_tokens [L]: the drafts each row verified, None: none): each row's last
    token, the one before it where every draft was accepted (else -1), the drafts accepted."""
    n = min(tokens.shape[0], last.shape[1])
    if tokens.shape[1] == 1:  # no drafts (a plain step): its one token, none accepted
        last[0, :n] = tokens[:n, 0]
        last[1, :n] = -1
        last[2, :n] = 0
        return
    count = (tokens >= 0).sum(dim=1, dtype=torch.int32)  # [L]
    accepted = (count - 1).clamp(min=0)
    lines = torch.arange(tokens.shape[0], device=tokens.device)
    final = tokens[lines, accepted.long()]
    verified = accepted if num_draft_tokens is None else num_draft_tokens
    all_kept = (accepted == verified) & (accepted > 0)
    before = torch.where(all_kept, tokens[lines, (accepted - 1).clamp(min=0).long()], -1)
    last[0, :n] = final[:n]
    last[1, :n] = before[:n]
    last[2, :n] = accepted[:n]
