"""Draft-free speculation: the engine's side of the methods whose drafts the host proposes
(no draft model, no draft KV). Before each speculative step the engine asks its drafter for each
decoding sequence's drafts; the scheduler gives them slots and the target verifies them with the
same rejection sampler as a draft model's (greedy proposals: q one-hot).

- `NgramDrafter` (`"method": "ngram"`): prompt lookup over the persistent batch's token rows,
  every sequence in one vectorized pass (ngram_proposer.py);
- `SuffixDrafter` (`"method": "suffix"`): suffix trees over each request's tokens and over the
  outputs of recent requests (suffix_proposer.py), kept in step with the scheduler's sequences:
  each step feeds the trees the tokens each decoding sequence gained, and a sequence the
  scheduler no longer tracks ends its request (its output joins the global tree);
- `ShadowDrafts`: while the adaptive policy drafts nothing, a few sequences' proposals scored
  against the tokens they decode, which keeps the policy's acceptance current.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedjax.core.input_batch import InputBatch
from pagedjax.core.ngram_proposer import NgramProposer
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.core.spec_policy import AdaptiveSpeculation
from pagedjax.core.suffix_proposer import SuffixDecodingProposer


def _proposes(seq: Sequence) -> bool:
    """Whether seq decodes from its last token, so the host may draft for it (not while it
    prefills, with no token to decode from yet, nor for a beam, whose policy picks tokens)."""
    return seq.num_computed_tokens + 1 == seq.num_tokens and not seq.policy_picks_tokens


class HostDrafter(Protocol):
    def propose(self, scheduler: Scheduler, batch: InputBatch, k: int,
                seqs: list[Sequence] | None = None, lag: bool = False) -> dict[int, list[int]]:
        """seq id → its drafts (1 to k of them) for this step; sequences without any absent.
        seqs: only these decoding sequences (None: every one). lag: for a step launched
        while the one before it runs (async scheduling), whose token the host has not seen:
        k + 1 drafts from the tokens it has, the first (a guess of the token in flight)
        dropped; verification accepts them only where that guess was right, or by chance."""
        ...


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.lagged = NgramProposer(config.num_speculative_tokens + 1,
                                    config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, scheduler: Scheduler, batch: InputBatch, k: int,
                seqs: list[Sequence] | None = None, lag: bool = False) -> dict[int, list[int]]:
        """From the tokens each row of the persistent batch holds (a sequence it holds no row
        for is prefilling)."""
        del scheduler
        if seqs is None:
            seq_ids = list(batch.row_of)
            rows = np.fromiter(batch.row_of.values(), np.int64, len(seq_ids))
        else:
            seq_ids = [seq.seq_id for seq in seqs if seq.seq_id in batch.row_of]
            rows = np.array([batch.row_of[seq_id] for seq_id in seq_ids], np.int64)
        if not seq_ids:
            return {}
        proposer = self.lagged if lag else self.proposer
        drafts, counts = proposer.propose(batch.token_ids, batch.num_tokens, rows)
        if lag:  # the first draft guessed the token in flight
            drafts, counts = drafts[:, 1:], np.maximum(counts - 1, 0)
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

    def propose(self, scheduler: Scheduler, batch: InputBatch, k: int,
                seqs: list[Sequence] | None = None, lag: bool = False) -> dict[int, list[int]]:
        del batch
        seen = self._seen
        for seq_id in seen.keys() - scheduler.seqs.keys():  # finished or aborted since
            self.proposer.stop(seq_id)
            del seen[seq_id]
        proposals = {}
        for seq in scheduler.running if seqs is None else seqs:
            if not _proposes(seq):
                continue
            held = seen.get(seq.seq_id)
            if held is None:
                held = seq.num_prompt_tokens
                self.proposer.start(seq.seq_id, seq.token_ids[:held])
            if seq.num_tokens > held:
                self.proposer.extend(seq.seq_id, seq.token_ids[held:])
            seen[seq.seq_id] = seq.num_tokens
            drafts = self.proposer.propose(seq.seq_id, k + lag)[lag:]
            if drafts:
                proposals[seq.seq_id] = drafts
        return proposals


class ShadowDrafts:
    """While the adaptive policy drafts nothing, a few sequences' drafts are still proposed and
    scored against the tokens those sequences then decode, so that the acceptance the policy
    decides on stays current at no step's cost (AdaptiveSpeculation.observe_drafts). Scored as
    verification would: the drafts accepted are the longest prefix the decoded tokens match,
    exactly what greedy verification accepts, and under sampling a draft matches the sampled
    token with the probability rejection sampling accepts it (its q is one-hot). Without them
    only the policy's probes (one step in 32, the smallest k) drafted while drafting was off,
    and a change of prompts whose drafts pay took hundreds of steps to show.

    Host work a step: at most NUM_SEQS sequences' proposals, made and scored.
    """

    NUM_SEQS = 4

    def __init__(self, drafter: HostDrafter, num_speculative_tokens: int) -> None:
        self.drafter, self.k = drafter, num_speculative_tokens
        # seq id → (its first draft's position, the drafts)
        self.pending: dict[int, tuple[int, list[int]]] = {}
        self._cursor = 0  # where in the running sequences the next picks start

    def step(self, scheduler: Scheduler, batch: InputBatch,
             policy: AdaptiveSpeculation) -> None:
        """After a step's tokens are appended: policy.observe_drafts(drafts, accepted) for each
        proposal whose sequence has decoded past it; then the next NUM_SEQS decoding sequences
        in turn propose (policy.observe_matching: how many of them would have drafted), and
        those without a proposal pending keep theirs."""
        seqs = scheduler.seqs
        for seq_id, (start, drafts) in list(self.pending.items()):
            seq = seqs.get(seq_id)
            if seq is None or seq.is_finished:  # cut short: its tokens would score too few
                del self.pending[seq_id]
            elif seq.num_tokens >= start + len(drafts):
                decoded = seq.token_ids[start : start + len(drafts)]
                policy.observe_drafts(len(drafts), next(
                    (j for j, (a, b) in enumerate(zip(decoded, drafts)) if a != b), len(drafts)))
                del self.pending[seq_id]
        running = scheduler.running
        picks: list[Sequence] = []
        scanned = 0
        while scanned < len(running) and len(picks) < self.NUM_SEQS:
            seq = running[(self._cursor + scanned) % len(running)]
            scanned += 1
            if _proposes(seq):
                picks.append(seq)
        self._cursor += scanned
        if not picks:
            return
        proposals = self.drafter.propose(scheduler, batch, self.k, picks)
        policy.observe_matching(len(picks), len(proposals))
        for seq_id, drafts in proposals.items():
            self.pending.setdefault(seq_id, (seqs[seq_id].num_tokens, drafts))


def make_host_drafter(config: SpeculativeConfig) -> HostDrafter | None:
    """The drafter of a host method; None for a draft model."""
    drafter = {"ngram": NgramDrafter, "suffix": SuffixDrafter}.get(config.method)
    return None if drafter is None else drafter(config)
