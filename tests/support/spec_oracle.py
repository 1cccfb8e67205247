"""A readable batch-1 speculative decoding step in NumPy: the oracle for the batched samplers.

Leviathan et al. 2023, in the shape of gpt-fast's `speculative_decode`: walk the drafts, accept
each with probability min(1, p/q), and at the first rejection draw a recovered token from the
residual max(p - q, 0); if every draft is accepted, draw a bonus token from the target. The
randomness is passed in, so the batched samplers can be fed the very same uniforms.
"""

from __future__ import annotations

import numpy as np


def gumbel_argmax(weights: np.ndarray, uniforms: np.ndarray) -> int:
    """A sample from normalize(weights) [V] by Gumbel-max with the given uniforms [V] in (0, 1)."""
    with np.errstate(divide="ignore"):  # log(0) = -inf: zero-weight tokens never win
        return int(np.argmax(np.log(weights) - np.log(-np.log(uniforms))))


def speculative_step_reference(target_probs: np.ndarray, draft_tokens: np.ndarray,
                               draft_probs: np.ndarray, u_accept: np.ndarray,
                               gumbel_uniforms: np.ndarray) -> list[int]:
    """One row's output tokens: the accepted drafts, then one recovered or bonus token.

    target_probs    [k+1, V] float32: p_j, the target's sampling distribution at position j
    draft_tokens    [k] int: d_j, drawn by the draft from q_j
    draft_probs     [k, V] float32: q_j
    u_accept        [k] float32: the acceptance uniform of each draft
    gumbel_uniforms [k+1, V] float32: the Gumbel-max uniforms of each position
    A greedy row passes one-hot p: drafts equal to the argmax are accepted, and any other token
    is rejected and recovered as the argmax, which is greedy decoding.
    """
    output: list[int] = []
    for j, token in enumerate(draft_tokens):
        p, q = target_probs[j], draft_probs[j]
        if u_accept[j] * q[token] < p[token]:  # u < min(1, p/q), without dividing by q = 0
            output.append(int(token))  # accepted
            continue
        residual = np.maximum(p - q, np.float32(0.0))
        if not residual.any():  # p == q up to rounding: any draw from p is exact
            residual = p
        return output + [gumbel_argmax(residual, gumbel_uniforms[j])]  # recovered
    k = len(draft_tokens)
    return output + [gumbel_argmax(target_probs[k], gumbel_uniforms[k])]  # bonus
