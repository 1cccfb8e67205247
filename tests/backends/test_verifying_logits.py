"""A step verifying the host's drafts scores its real token rows alone (jax's
verifying_logits; torch's head is counted in tests/e2e/test_spec_decode.py): the head is asked
for the step's real tokens, each sequence's last token then the d <= K drafts it proposed, and
position j of sequence l reads row min(j, d_l) of its own rows."""

from __future__ import annotations

import numpy as np


def test_the_head_runs_on_the_real_rows_and_each_position_reads_its_own() -> None:
    import jax.numpy as jnp

    from pagedjax.backends.jax.step import verifying_logits

    # K = 3, L = 4 sequences: d = 2, 0, 3 drafts and a padding sequence; T = L (K + 1) = 16
    # token rows of which 1 + 2 + 1 + 1 + 3 = 8 are real
    num_drafts, k, vocab = [2, 0, 3], 3, 5
    starts = np.cumsum([0, *(1 + d for d in num_drafts)])  # [0, 3, 4, 8]
    indices = np.zeros((4, k + 1), np.int32)  # the padding sequence reads row 0
    for seq, d in enumerate(num_drafts):
        indices[seq] = starts[seq] + np.minimum(np.arange(k + 1), d)
    hidden = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)  # [T, H]
    asked = []

    def head(x, num_rows):  # a packed CPU head: rows past num_rows stay zero
        asked.append((x.shape[0], int(num_rows)))
        rows = jnp.arange(x.shape[0])[:, None] < num_rows
        return jnp.where(rows, x[:, :1] * jnp.arange(1, vocab + 1), 0.0)  # [T, V]

    got = np.asarray(verifying_logits(head, jnp.asarray(hidden), jnp.asarray(indices),
                                      jnp.int32(int(starts[-1]))))
    assert asked == [(16, 8)]
    want = hidden[indices.reshape(-1), :1] * np.arange(1, vocab + 1)  # each row's own logits
    np.testing.assert_array_equal(got, want)
