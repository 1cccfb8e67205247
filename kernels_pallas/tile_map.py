"""The tile map of the ragged paged attention kernel: which rows of which sequence each program
serves, computed with jnp on the device (no host sync, no while loop) from the batch metadata.

A row is one (query token, query head) pair of one KV head's group, laid out token-major
(row = token * G + head) within a sequence; a tile is `rows` consecutive rows of one sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def cdiv(a: jax.Array | int, b: int) -> jax.Array | int:
    """Ceiling division that keeps int32 arrays int32 (pl.cdiv promotes them under x64)."""
    return (a + b - 1) // b


class TileMap(NamedTuple):
    """Which rows of which sequence each program serves (device arrays)."""

    info: jax.Array  # [num_tiles, 4] int32: (seq, num_valid_rows, first_pair, first_pos)
    token: jax.Array  # [num_tiles, rows] int32: row of q for each tile row, -1 = unused
    head: jax.Array  # [num_tiles, rows] int32: query head within the group


def decode_tiles(
    query_start_loc: jax.Array,  # [S+1] int32
    kv_lens: jax.Array,  # [S] int32
    group: int,
    rows: int,
) -> TileMap:
    """One tile per sequence: its single query token times the G heads of the group."""
    num_seqs = kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    num_valid = jnp.where(q_lens == 1, group, 0).astype(jnp.int32)  # [S]
    info = jnp.stack([jnp.arange(num_seqs, dtype=jnp.int32), num_valid,
                      jnp.zeros_like(num_valid), kv_lens - 1], axis=1)
    row = jnp.arange(rows, dtype=jnp.int32)  # [rows]
    valid = row[None, :] < num_valid[:, None]  # [S, rows]
    token = jnp.where(valid, query_start_loc[:-1, None], -1)
    head = jnp.broadcast_to(jnp.minimum(row, group - 1), (num_seqs, rows))
    return TileMap(info, token.astype(jnp.int32), head)


def multi_token_tiles(
    query_start_loc: jax.Array,  # [S+1] int32
    kv_lens: jax.Array,  # [S] int32
    num_tokens: int,
    group: int,
    rows: int,
) -> TileMap:
    """Tiles of `rows` consecutive (token, head) pairs, each inside one sequence."""
    num_seqs = kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    num_pairs = q_lens * group  # [S]
    tiles_per_seq = cdiv(num_pairs, rows)  # [S]
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)  # [S]
    num_tiles = num_multi_token_tiles(num_tokens, num_seqs, group, rows)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)  # [num_tiles]
    # compare_all: no while loop (a loop's predicate would sync with the host on GPU).
    seq = jnp.searchsorted(tile_end, tile, side="right", method="compare_all")
    seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
    first_pair = (tile - (tile_end - tiles_per_seq)[seq]) * rows  # [num_tiles]
    num_valid = jnp.where(tile < tile_end[-1], jnp.clip(num_pairs[seq] - first_pair, 0, rows), 0)
    first_pos = kv_lens[seq] - q_lens[seq]  # position of the sequence's first query
    info = jnp.stack([seq, num_valid, first_pair, first_pos], axis=1).astype(jnp.int32)
    row = jnp.arange(rows, dtype=jnp.int32)  # [rows]
    pair = first_pair[:, None] + row[None, :]  # [num_tiles, rows]
    token = jnp.where(row[None, :] < num_valid[:, None],
                      query_start_loc[seq][:, None] + pair // group, -1)
    return TileMap(info, token.astype(jnp.int32), (pair % group).astype(jnp.int32))


def num_multi_token_tiles(num_tokens: int, num_seqs: int, group: int, rows: int) -> int:
    """Static bound: sum_s ceil(q_s G / rows) <= (T G + S (rows - 1)) / rows, and <= T G."""
    pairs = num_tokens * group
    return max(1, min(pairs, (pairs + num_seqs * (rows - 1)) // rows))
