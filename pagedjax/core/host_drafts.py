"""Draft-free speculation: the engine's side of the methods whose drafts the host proposes
(no draft model, no draft KV). Before each speculative step the engine asks its drafter for each
decoding sequence's drafts; the scheduler gives them slots and the target verifies them with the
same rejection sampler as a draft model's (greedy proposals: q one-hot).

- `NgramDrafter` (`"method": "ngram"`): prompt lookup over the persistent batch's token rows,
  every sequence in one vectorized pass (ngram_proposer.py);
- `SuffixDrafter` (`"method": "suffix"`): suffix trees over each request's tokens and over the
  outputs of recent requests (suffix_proposer.py), kept in step with the scheduler's sequences:
  each step feeds the trees the tokens each decoding sequence gained, and a sequence the
  scheduler no longer tracks ends its request (its output joins the global tree).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedjax.core.input_batch import InputBatch
from pagedjax.core.ngram_proposer import NgramProposer
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.core.suffix_proposer import SuffixDecodingProposer


class HostDrafter(Protocol):
    def propose(self, scheduler: Scheduler, batch: InputBatch, k: int) -> dict[int, list[int]]:
        """seq id → its drafts (1 to k of them) for this step; sequences without any absent."""
        ...


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)

    def propose(self, scheduler: Scheduler, batch: InputBatch, k: int) -> dict[int, list[int]]:
        """From the tokens each row of the persistent batch holds (a sequence it holds no row
        for is prefilling)."""
        del scheduler
        if not batch.row_of:
            return {}
        seq_ids = list(batch.row_of)
        rows = np.fromiter(batch.row_of.values(), np.int64, len(seq_ids))
        drafts, counts = self.proposer.propose(batch.token_ids, batch.num_tokens, rows)
        counts = np.minimum(counts, k)
        return {seq_ids[i]: drafts[i, : counts[i]].tolist() for i in np.flatnonzero(counts)}


class SuffixDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.proposer = SuffixDecodingProposer(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob)
        self._seen: dict[int, int] = {}  # seq id → tokens its tree holds

    def propose(self, scheduler: Scheduler, batch: InputBatch, k: int) -> dict[int, list[int]]:
        del batch
        seqs, seen = scheduler.seqs, self._seen
        for seq_id in seen.keys() - seqs.keys():  # finished or aborted since the last step
            self.proposer.stop(seq_id)
            del seen[seq_id]
        proposals = {}
        for seq in scheduler.running:
            if seq.num_computed_tokens + 1 != seq.num_tokens or seq.policy_picks_tokens:
                continue  # prefilling (no token to decode from yet), or a beam
            held = seen.get(seq.seq_id)
            if held is None:
                held = seq.num_prompt_tokens
                self.proposer.start(seq.seq_id, seq.token_ids[:held])
            if seq.num_tokens > held:
                self.proposer.extend(seq.seq_id, seq.token_ids[held:])
            seen[seq.seq_id] = seq.num_tokens
            drafts = self.proposer.propose(seq.seq_id, k)
            if drafts:
                proposals[seq.seq_id] = drafts
        return proposals


def make_host_drafter(config: SpeculativeConfig) -> HostDrafter | None:
    """The drafter of a host method; None for a draft model."""
    drafter = {"ngram": NgramDrafter, "suffix": SuffixDrafter}.get(config.method)
    return None if drafter is None else drafter(config)
