"""Speculative decoding: a small draft model proposes, the target verifies in one ragged pass.

Draft and target share one BlockManager and one block table per sequence; each runner keeps its
own KV cache indexed by the same block ids. Each step, before the target runs:

1. the draft catches up on the tokens it has not computed (the target's new tokens, plus the
   last draft when all were accepted) and proposes draft 1 from its last position;
2. k - 1 single-token draft passes propose drafts 2..k;

then the target computes its new tokens and the k drafts, and the rejection sampler keeps the
target's distribution exactly (Leviathan et al. 2023). Rejected drafts roll back by bookkeeping
(`num_computed_tokens`); the draft's q distributions never leave the device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedjax.batch import build_model_input
from pagedjax.random import derive_seed
from pagedjax.scheduler_output import SampleSpec, ScheduledSequence, SchedulerOutput
from pagedjax.sequence import Sequence

_DRAFT_STREAM = 0x0D8AF7  # the draft samples from its own random stream


@dataclass(frozen=True)
class SpeculativeConfig:
    model: str  # draft checkpoint directory
    num_speculative_tokens: int  # k: drafts proposed per sequence and step

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        unknown = set(config) - {"model", "num_speculative_tokens"}
        if unknown or "model" not in config:
            raise ValueError(f"speculative_config={config!r} must be "
                             "{'model': DRAFT_DIR, 'num_speculative_tokens': k}.")
        k = config.get("num_speculative_tokens", 3)
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer in [1, 16].")
        if not (Path(config["model"]) / "config.json").is_file():
            raise ValueError(f"speculative model={config['model']!r} is not a Hugging Face "
                             "checkpoint directory (no config.json).")
        return cls(str(config["model"]), k)

    def check_vocabulary(self, target_dir: str, target_tokenizer: Any, draft_tokenizer: Any,
                         target_vocab_size: int, draft_vocab_size: int) -> None:
        """The draft must speak the target's vocabulary: same size and same token strings."""
        same_size = target_vocab_size == draft_vocab_size
        same_tokens = (target_tokenizer is None or draft_tokenizer is None
                       or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab())
        if not (same_size and same_tokens):
            raise ValueError(
                f"draft {self.model!r} (vocab_size {draft_vocab_size}) does not share the "
                f"target {target_dir!r}'s tokenizer vocabulary (vocab_size {target_vocab_size}"
                f"{'' if same_tokens else ', different tokens'}); use a draft trained with the "
                "target's tokenizer.")


def read_vocab_size(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


class DraftProposer:
    """Runs the draft runner for one scheduled step and fills each entry's spec_token_ids."""

    def __init__(self, runner: Any, *, block_size: int, max_blocks_per_seq: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq

    def propose(self, out: SchedulerOutput,
                seqs: dict[int, Sequence]) -> tuple[list[Any], dict[int, list[int]]]:
        """Returns the draft's q per pass (device handles) and, per sequence, its row in each."""
        passes: list[Any] = []
        draft_rows: dict[int, list[int]] = {}
        num_passes = max((e.num_spec_tokens for e in out.scheduled), default=0)
        for j in range(max(num_passes, 1)):
            entries = self._pass_entries(out, seqs, j)
            step = SchedulerOutput(entries, out.block_copies if j == 0 else [], [], 0)
            result = self.runner.execute(build_model_input(
                step, block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
                return_probs=num_passes > 0))
            passes.append(result.probs)
            row = 0
            for draft_entry, entry in zip(entries, self._proposing(out, j)):
                seqs[entry.seq_id].num_draft_computed_tokens = draft_entry.end_pos
                if draft_entry.samples:
                    entry.spec_token_ids.append(int(result.sampled_token_ids[row]))
                    draft_rows.setdefault(entry.seq_id, []).append(row)
                    row += 1
        return passes, draft_rows

    @staticmethod
    def _proposing(out: SchedulerOutput, j: int) -> list[ScheduledSequence]:
        """Pass 0 runs every scheduled sequence (to catch up); pass j > 0 those drafting > j."""
        return [e for e in out.scheduled if j == 0 or e.num_spec_tokens > j]

    def _pass_entries(self, out: SchedulerOutput, seqs: dict[int, Sequence],
                      j: int) -> list[ScheduledSequence]:
        entries = []
        for e in self._proposing(out, j):
            seq = seqs[e.seq_id]
            samples = [self._sample(seq, j)] if e.num_spec_tokens > j else []
            if j == 0:
                start = seq.num_draft_computed_tokens
                token_ids = seq.token_ids[start : e.end_pos]
            else:
                start, token_ids = e.end_pos + j - 1, e.spec_token_ids[-1:]
            entries.append(ScheduledSequence(e.seq_id, token_ids, start, e.block_table, samples))
        return entries

    @staticmethod
    def _sample(seq: Sequence, j: int) -> SampleSpec:
        return SampleSpec(seq.seq_id, seq.sampling_params,
                          derive_seed(seq.rng_seed, _DRAFT_STREAM),
                          seq.num_output_tokens + j, banned_token_ids=[])
