"""Token-id prompts for end-to-end tests: lengths around a block (16 tokens), a long one, and
two sharing a prefix of three blocks."""

from __future__ import annotations

import numpy as np

PROMPT_LENS = [1, 15, 16, 17, 120, 7, 33, 64]


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """PROMPT_LENS random prompts, and two sharing a 48-token prefix (lengths 53 and 68)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab_size, n).tolist() for n in PROMPT_LENS]
    shared = rng.integers(1, vocab_size, 48).tolist()
    prompts += [shared + rng.integers(1, vocab_size, n).tolist() for n in (5, 20)]
    return prompts
