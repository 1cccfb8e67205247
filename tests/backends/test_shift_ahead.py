"""A speculative step launched before the last one's tokens reached the host, moved on the device
by the drafts the last step accepted (spec_step.shift_ahead on both backends): against the
fields worked out by hand, with a sequence whose drafts were all accepted, one with none, one
scheduled with its tokens known (not moved: a longer catch-up whose rows move down) and a
padding sequence; and the carry each step leaves the next (spec_step.carry / keep_carry)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.core.step_shapes import BatchLayout

LAYOUT = BatchLayout(num_tokens=12, num_seqs=4, max_blocks_per_seq=4, num_spec_tokens=2,
                     draft=True, decode=False)
BLOCK_SIZE = 4
# [3, R]: the last step's rows 0..3: last token, the one before it where every draft was
# accepted (-1 else), drafts accepted. Row 2 (sequence 0's last step) accepted both its drafts;
# row 0 (sequence 1's) none.
LAST = np.array([[66, 0, 55, 0], [-1, 0, 77, 0], [0, 0, 2, 0]], np.int32)


def host_fields() -> dict[str, np.ndarray]:
    """The step as the host built it: sequences 0 and 1 as though their last steps accepted no
    draft (one catch-up token each), sequence 2 known (a catch-up of three), 3 padding."""
    i = np.int32
    return {
        "query_start_loc": np.array([0, 3, 6, 9, 9], i),
        "input_rows": np.array([3, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0], i),
        "positions": np.array([9, 10, 11, 8, 9, 10, 5, 6, 7, 0, 0, 0], i),
        "slot_mapping": np.array([13, 14, 15, 28, 29, 30, 41, 42, 43, -1, -1, -1], i),
        "kv_lens": np.array([12, 11, 8, 0], i),
        "rng_step": np.array([100, 200, 300, 0], i),
        "sample_seq": np.array([0, 1, 2, 3], i),
        "block_tables": np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]], i),
        "draft_query_start_loc": np.array([0, 1, 2, 5, 5], i),
        "draft_input_ids": np.array([0, 0, 31, 32, 33, 0, 0, 0, 0, 0, 0, 0], i),
        "draft_positions": np.array([9, 8, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0], i),
        "draft_slot_mapping": np.array([13, 28, 39, 40, 41] + [-1] * 7, i),
        "draft_kv_lens": np.array([10, 9, 6, 0], i),
    }


EXPECTED = {
    "positions": [11, 12, 13, 8, 9, 10, 5, 6, 7, 0, 0, 0],  # sequence 0 two later
    "slot_mapping": [15, 16, 17, 28, 29, 30, 41, 42, 43, -1, -1, -1],
    "kv_lens": [14, 11, 8, 0],
    "rng_step": [102, 200, 300, 0],
    # sequence 0 catches up on its last draft (77, never fed to the draft) and the new token
    # (55); sequence 1 on its new token (66); sequence 2's three rows move down one
    "draft_query_start_loc": [0, 2, 3, 6, 6],
    "draft_input_ids": [77, 55, 66, 31, 32, 33, 0, 0, 0, 0, 0, 0],
    "draft_positions": [10, 11, 8, 3, 4, 5, 0, 0, 0, 0, 0, 0],
    "draft_slot_mapping": [14, 15, 28, 39, 40, 41, -1, -1, -1, -1, -1, -1],
    "draft_kv_lens": [12, 9, 6, 0],
}

# a step's tokens [L, K+1] (-1 padded) and the drafts each row verified → the carry [3, R = 5]
TOKENS = np.array([[4, 5, 6], [7, -1, -1], [8, 9, -1], [3, -1, -1]], np.int32)
VERIFIED = np.array([2, 2, 2, 0], np.int32)
CARRY = [[6, 7, 9, 3, 0], [5, -1, -1, -1, -1], [2, 0, 1, 0, 0]]


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_shift_ahead_moves_what_the_last_step_accepted(backend: str) -> None:
    if backend == "jax":
        import jax.numpy as jnp

        from pagedjax.backends.jax.spec_step import shift_ahead

        fields = {name: jnp.asarray(x) for name, x in host_fields().items()}
        got = shift_ahead(fields, jnp.asarray(LAST), layout=LAYOUT, block_size=BLOCK_SIZE)
    else:
        import torch

        from pagedjax.backends.torch.spec_step import shift_ahead

        fields = {name: torch.from_numpy(x) for name, x in host_fields().items()}
        got = shift_ahead(fields, torch.from_numpy(LAST), layout=LAYOUT, block_size=BLOCK_SIZE)
    for name, want in EXPECTED.items():
        np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)


@pytest.mark.parametrize("tokens, verified, want", [
    (TOKENS, VERIFIED, CARRY),
    # a plain step's one token a row
    (TOKENS[:, :1], None, [[4, 7, 8, 3, 0], [-1] * 5, [0] * 5])])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_the_carry_holds_each_rows_last_token_and_its_drafts_accepted(backend: str, tokens,
                                                                     verified, want) -> None:
    if backend == "jax":
        import jax.numpy as jnp

        from pagedjax.backends.jax.spec_step import carry

        got = carry(jnp.asarray(tokens), jnp.zeros(len(tokens), jnp.int32)
                    if verified is None else jnp.asarray(verified), 5)
    else:
        import torch

        from pagedjax.backends.torch.spec_step import keep_carry

        got = torch.zeros(3, 5, dtype=torch.int32)
        got[1] = -1
        keep_carry(got, torch.from_numpy(np.ascontiguousarray(tokens)),
                   None if verified is None else torch.from_numpy(verified))
    np.testing.assert_array_equal(np.asarray(got), want)
