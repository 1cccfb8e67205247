"""n-gram prompt lookup (vLLM's `"method": "ngram"`): drafts copied from each sequence's own
tokens, with no draft model and no draft KV.

For a sequence whose tokens end in the n-gram g (prompt_lookup_min <= n <= prompt_lookup_max),
the proposal is the k tokens that followed the earliest earlier occurrence of g, for the longest
n that occurs earlier. Code edits, summaries and quotes repeat their prompt: there most drafts
are accepted; elsewhere few are proposed.

One vectorized pass over the persistent batch's token rows (input_batch.py) matches every
sequence at once: for each suffix length j, a comparison of every position with the token j
before the end; the run of matches ending at a position is the length of the n-gram that
occurs there. Cost: prompt_lookup_max passes over [rows, longest context] int32, about 40 NumPy
calls whatever the rows. Up to FEW_ROWS rows (ShadowDrafts' four, a small batch) each row's
n-grams are searched in its bytes instead (`bytes.find`, longest first), about four times
cheaper for one row (RESULTS.md, stop 70).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    FEW_ROWS = 8  # up to this many rows, a search per row (at 32, the vectorized pass is cheaper)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max="
                             f"{prompt_lookup_max} must satisfy 1 <= min <= max.")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray,
                which: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """token_ids [R, C] int: each row's tokens, valid below num_tokens [R]; which [n]: the
        rows to propose for (None: all). Returns (drafts [n, k] int32, counts [n] int64): the
        i-th of them proposes drafts[i, :counts[i]]."""
        if which is None:
            which = np.arange(len(num_tokens))
        if len(which) <= self.FEW_ROWS:
            return self._propose_each(token_ids, num_tokens, which)
        rows = len(which)
        drafts = np.zeros((rows, self.k), np.int32)
        counts = np.zeros(rows, np.int64)
        lengths = np.asarray(num_tokens, np.int64)[which]
        if not rows or lengths.max(initial=0) <= self.min_n:
            return drafts, counts
        width = int(lengths.max())
        tokens = token_ids[which, :width]
        row_index = np.arange(rows)
        pos = np.arange(width - 1)  # [P]: where an earlier occurrence may end
        # An occurrence ending at p leaves at least one token to propose: p < length - 1.
        alive = pos[None, :] < (lengths - 1)[:, None]  # [R, P]
        run = np.zeros((rows, width - 1), np.int64)
        for j in range(min(self.max_n, width - 1)):
            last = tokens[row_index, np.maximum(lengths - 1 - j, 0)]  # [R]: token j from the end
            earlier = np.zeros((rows, width - 1), bool)
            earlier[:, j:] = tokens[:, : width - 1 - j] == last[:, None]  # tokens[p - j]
            alive &= earlier
            if not alive.any():
                break
            run += alive
        best = run.max(axis=1)  # [R] the longest n-gram that occurs earlier
        found = best >= self.min_n
        if not found.any():
            return drafts, counts
        end = np.argmax(run == best[:, None], axis=1)  # [R] its earliest occurrence's end
        counts = np.where(found, np.minimum(self.k, lengths - 1 - end), 0)
        take = np.arange(self.k)[None, :] < counts[:, None]  # [R, k]
        source = np.minimum(end[:, None] + 1 + np.arange(self.k)[None, :], width - 1)
        drafts[:] = np.where(take, tokens[row_index[:, None], source], 0)
        return drafts, counts

    def _propose_each(self, token_ids: np.ndarray, num_tokens: np.ndarray,
                      which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """propose() a row at a time: the earliest occurrence of the row's last n tokens
        among its earlier ones, as bytes (one that starts inside a token is no occurrence),
        for n from prompt_lookup_max down."""
        drafts = np.zeros((len(which), self.k), np.int32)
        counts = np.zeros(len(which), np.int64)
        for i, r in enumerate(which.tolist()):
            length = int(num_tokens[r])
            row = token_ids[r, :length]
            earlier, size = row[: length - 1].tobytes(), row.itemsize  # occurrences end there
            for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
                suffix = row[length - n :].tobytes()
                at = earlier.find(suffix)
                while at % size and at >= 0:
                    at = earlier.find(suffix, at + 1)
                if at >= 0:
                    end = at // size + n - 1  # where the occurrence ends
                    counts[i] = min(self.k, length - 1 - end)
                    drafts[i, : counts[i]] = row[end + 1 : end + 1 + counts[i]]
                    break
        return drafts, counts


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one sequence at a time (tests): the longest n in [min_n, max_n] whose
    last-n-gram occurs earlier, its earliest occurrence, the (up to) k tokens after it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(0, length - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []
