"""The draft side of a speculative step on the torch runner: the semantics of
backends/jax/spec_step.py, op for op, with no host synchronisation (no shape depends on data).

1. catch-up: one ragged draft pass over the tokens the draft has not computed, up to each
   sequence's last real token, whose logits give draft 1 (a mixed step, K = 0, stops there);
2. K - 1 single-token draft passes, each feeding the previous draft (captured in the step's CUDA
   graph on GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedjax import random as prng
from pagedjax.backends.torch.model import AttentionMetadata, KVCache
from pagedjax.backends.torch.rejection_sampler import sampling_probs
from pagedjax.backends.torch.sampler import _mix32, uniform
from pagedjax.core.batch import StepFlags
from pagedjax.core.step_shapes import BatchLayout

# (input_ids [T], kv_caches, metadata, logits_indices [L]) -> logits [L, V] (caches written)
DraftForward = Callable[[torch.Tensor, list[KVCache], AttentionMetadata, torch.Tensor],
                        torch.Tensor]
_KNOBS = ("temperature", "top_k", "top_p", "min_p")


def propose_drafts(forward: DraftForward, kv_caches: list[KVCache], b: dict[str, torch.Tensor],
                   sampling: dict[str, torch.Tensor], flags: StepFlags,
                   rope: tuple[torch.Tensor, torch.Tensor], *, layout: BatchLayout,
                   max_query_len: int, num_tokens: int | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Returns (drafts [S, K] int32, q [S, K, V] float32 or None when every row is greedy);
    (None, None) in a mixed step (K = 0: the catch-up only).

    b: the step's unpacked fields on the device; sampling: per-row knobs [L] (seeds int64);
    flags: the step's (host copy); max_query_len: a host bound on the catch-up pass's longest
    query (the launch); num_tokens: the catch-up's real tokens, when only those run (None: T).
    """
    num_seqs, k = layout.num_seqs, layout.num_spec_tokens
    td = layout.num_tokens if num_tokens is None else max(num_tokens, 1)  # a row to read
    meta = AttentionMetadata(b["draft_positions"][:td], b["draft_slot_mapping"][:td],
                             b["draft_query_start_loc"], b["draft_kv_lens"], b["block_tables"],
                             *rope, max_query_len=max_query_len)
    if not k:
        forward(b["draft_input_ids"][:td], kv_caches, meta,
                torch.zeros(0, dtype=torch.long, device=meta.kv_lens.device))
        return None, None
    all_greedy = not flags.sampled
    rows = b["seq_sample_row"].long()  # [S]: each sequence samples with its row's knobs
    knobs = {name: sampling[name][rows] for name in _KNOBS}
    seeds = _mix32(sampling["rng_seed"][rows] ^ prng.DRAFT_STREAM)  # [S]
    steps = sampling["rng_step"][rows]  # [S]

    def sample(logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft j + 1 from logits [S, V]: (tokens [S], q [S, V] or None)."""
        if all_greedy:
            return torch.argmax(logits, dim=-1).to(torch.int32), None
        q = sampling_probs(logits, knobs, all_greedy=False, use_filters=flags.filters)
        u = uniform(seeds, (steps + j) & 0xFFFFFFFF, logits.shape[-1])
        return torch.argmax(torch.log(q) - torch.log(-torch.log(u)), dim=-1).to(torch.int32), q

    last_rows = (b["draft_query_start_loc"][1:] - 1).clamp(min=0)  # [S]
    first, q = sample(forward(b["draft_input_ids"][:td], kv_caches, meta, last_rows), 0)
    drafts, probs = [first], [q]
    end = b["draft_kv_lens"]  # [S] position after the real tokens, for sequences that draft
    index = b["draft_token_index"].long().clamp(max=layout.num_tokens - 1)  # [S, K]
    slots = b["slot_mapping"][index]  # [S, K]: the target's slot of draft j, the draft's too
    seq_rows = torch.arange(num_seqs, device=end.device)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=end.device)
    for j in range(1, k):  # feed draft j (at position end + j - 1), sample draft j + 1
        # A sequence that drafts fewer than j + 1 tokens writes nothing and reads one key.
        active = j < b["num_drafts"]  # [S]
        positions = torch.where(active, end + j - 1, 0)
        step_meta = AttentionMetadata(
            positions, torch.where(active, slots[:, j - 1], -1), query_start_loc,
            positions + 1, b["block_tables"], *rope, max_query_len=1)
        token, q = sample(forward(drafts[-1], kv_caches, step_meta, seq_rows), j)
        drafts.append(token)
        probs.append(q)
    return torch.stack(drafts, dim=1), None if all_greedy else torch.stack(probs, dim=1)
