"""Penalties, logit_bias and banned tokens as (row, token) entries of a fixed-size list.

What these features change is sparse: a few tokens of a few rows. Each distinct (row, token)
they touch becomes one entry (its flags, its count of output occurrences, its bias), padded to
the engine's capacity E, so a step has the same shapes whatever its rows ask for, and a sampler
touches E logits, never [rows, vocabulary]:

    x = logits[row, token]
    x = -inf if BANNED                  (min_tokens: EOS and stop ids)
    x = x + bias                        (logit_bias, clamped to +-100)
    x = x / rep if x > 0 else x * rep   if SEEN (in the prompt or the output: repetition_penalty)
    x = x - frequency * count - presence * (count > 0)   (output occurrences)
    logits[row, token] = x

in vLLM's order, op for op as the dense formulation (so the same bits). The scheduler keeps
each step's entries within E (`Sequence.num_logit_entries`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pagedjax.core.scheduler_output import SampleSpec


class EntryFlag(enum.IntFlag):
    BANNED = 1  # masked to -inf
    SEEN = 2  # in the prompt or the output: repetition_penalty applies


@dataclass
class LogitEntries:
    """E entries (row -1 = padding), sorted by (row, token); ints [4, E] = rows, token ids,
    output counts, flags; bias [E] float32."""

    ints: np.ndarray  # [4, E] int32
    bias: np.ndarray  # [E] float32
    num_entries: int  # the real ones, first


def build_logit_entries(samples: list[SampleSpec], capacity: int,
                        sample_rows: list[int] | None = None) -> LogitEntries | None:
    """The entries of a step's sample rows (row r = samples[r], or sample_rows[r] when given:
    the rows that may have any); None if no row has any."""
    rows, tokens, counts, flags, bias = [], [], [], [], []
    for r, spec in zip(range(len(samples)) if sample_rows is None else sample_rows, samples):
        params = spec.params
        for token in spec.banned_token_ids:
            rows.append(r), tokens.append(token), counts.append(0)
            flags.append(EntryFlag.BANNED), bias.append(0.0)
        for token, value in (params.logit_bias or {}).items():
            rows.append(r), tokens.append(token), counts.append(0), flags.append(0)
            bias.append(value)
        for token in spec.penalty_prompt_token_ids:
            rows.append(r), tokens.append(token), counts.append(0)
            flags.append(EntryFlag.SEEN), bias.append(0.0)
        for token in spec.output_token_ids:
            rows.append(r), tokens.append(token), counts.append(1)
            flags.append(EntryFlag.SEEN), bias.append(0.0)
    if not rows:
        return None
    keys = (np.asarray(rows, np.int64) << 32) | np.asarray(tokens, np.int64)
    unique, inverse = np.unique(keys, return_inverse=True)
    n = len(unique)
    if n > capacity:
        raise ValueError(f"a step carries {n} penalty, logit_bias and min_tokens entries, over "
                         f"the engine's {capacity}")
    ints = np.zeros((4, capacity), np.int32)
    ints[0] = -1
    ints[0, :n] = unique >> 32
    ints[1, :n] = unique & 0xFFFFFFFF
    np.add.at(ints[2], inverse, np.asarray(counts, np.int32))
    np.bitwise_or.at(ints[3], inverse, np.asarray(flags, np.int32))
    merged_bias = np.zeros(capacity, np.float32)
    np.add.at(merged_bias, inverse, np.asarray(bias, np.float32))
    return LogitEntries(ints, merged_bias, n)
