"""Float64 NumPy oracles: a loop over sequences for every attention kernel, and the samplers'
argmax and log-sum-exp for the logits kernel."""

from __future__ import annotations

import numpy as np


def naive_ragged_paged_attention(
    q: np.ndarray,  # [T, Hq, D]
    k_cache: np.ndarray,  # [N, Hkv, bs, D]
    v_cache: np.ndarray,  # [N, Hkv, bs, D]
    kv_lens: np.ndarray,  # [S]
    block_tables: np.ndarray,  # [S, M]
    query_start_loc: np.ndarray,  # [S+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> np.ndarray:  # [T, Hq, D] float64, padding rows zero
    q = np.asarray(q, np.float64)
    k_cache = np.asarray(k_cache, np.float64)
    v_cache = np.asarray(v_cache, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size = k_cache.shape[2]
    group = num_q_heads // k_cache.shape[1]
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    for s in range(len(kv_lens)):
        start, end, kv_len = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(kv_lens[s])
        if end == start:
            continue
        slots = np.arange(kv_len)
        blocks = np.asarray(block_tables[s])[slots // block_size]
        keys = k_cache[blocks, :, slots % block_size]  # [L, Hkv, D]
        values = v_cache[blocks, :, slots % block_size]  # [L, Hkv, D]
        for i, t in enumerate(range(start, end)):
            pos = kv_len - (end - start) + i
            visible = slots <= pos
            if sliding_window is not None:
                visible &= pos - slots < sliding_window
            for h in range(num_q_heads):
                logits = keys[:, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                logits = np.where(visible, logits, -np.inf)
                p = np.exp(logits - logits.max())
                out[t, h] = (p / p.sum()) @ values[:, h // group]
    return out


def soft_cap_effect(case: dict, *, soft_cap: float, **kwargs) -> float:
    """How far the uncapped oracle is from the capped one on this case (per-row relative error):
    a soft-cap test only shows the cap is applied when this is well above its bound."""
    capped = naive_ragged_paged_attention(**case, soft_cap=soft_cap, **kwargs)
    return per_row_relative_error(naive_ragged_paged_attention(**case, **kwargs), capped)


def make_ragged_case(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_padding_rows: int = 0,
    dtype=np.float32,
) -> dict:
    """Random q and caches with randomly permuted block tables (spare blocks left unused)."""
    assert all(q <= kv for q, kv in zip(q_lens, kv_lens))
    max_blocks = max(-(-kv // block_size) for kv in kv_lens) if kv_lens else 1
    num_blocks = sum(-(-kv // block_size) for kv in kv_lens) + 3
    perm = rng.permutation(num_blocks)
    block_tables = np.zeros((len(kv_lens), max_blocks), np.int32)
    cursor = 0
    for s, kv in enumerate(kv_lens):
        n = -(-kv // block_size)
        block_tables[s, :n] = perm[cursor : cursor + n]
        cursor += n
    num_tokens = sum(q_lens) + num_padding_rows
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    return dict(
        q=rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(dtype),
        k_cache=rng.standard_normal(shape).astype(dtype),
        v_cache=rng.standard_normal(shape).astype(dtype),
        kv_lens=np.asarray(kv_lens, np.int32),
        block_tables=block_tables,
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
    )


def per_row_relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max over (token, head) rows of |out - ref| / max(|ref|, 1e-6)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    err = np.linalg.norm(out - ref, axis=-1)
    scale = np.maximum(np.linalg.norm(ref, axis=-1), 1e-6)
    return float(np.max(err / scale))


def logits_stats_cases() -> list[np.ndarray]:
    """Float32 logits [R, V]: a large odd vocabulary, ties (small integers: the first index must
    win), a short row, a NaN row (the first NaN is the argmax, lse NaN), a row of -inf and one
    holding +inf."""
    rng = np.random.default_rng(0)
    big = (rng.standard_normal((5, 49155)) * 8).astype(np.float32)
    ties = rng.integers(-3, 4, size=(4, 37)).astype(np.float32)
    special = rng.standard_normal((4, 21)).astype(np.float32)
    special[0, 7] = special[0, 15] = np.nan
    special[1] = -np.inf
    special[2, 3] = np.inf
    return [big, ties, special, rng.standard_normal((3, 5)).astype(np.float32)]


def first_argmax(x: np.ndarray) -> np.ndarray:
    """[R] int32: each row's first index of the maximum, a NaN counting as the maximum."""
    nan = np.isnan(x)
    return np.where(nan.any(-1), nan.argmax(-1),
                    np.argmax(np.where(nan, -np.inf, x), -1)).astype(np.int32)


def logits_stats_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First index of the maximum (a NaN counting as the maximum); logsumexp in float64."""
    nan = np.isnan(x)
    argmax = first_argmax(x)
    x64 = x.astype(np.float64)
    top = np.max(np.where(nan, -np.inf, x64), -1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.where(np.isinf(top[:, 0]), top[:, 0],
                       top[:, 0] + np.log(np.exp(x64 - np.where(np.isinf(top), 0, top)).sum(-1)))
    return argmax, np.where(nan.any(-1), np.nan, lse)


def token_mask_cases() -> list[tuple[np.ndarray, np.ndarray]]:
    """(logits [R, V] float32, bitmask [R, W] int32): a vocabulary that is no multiple of 8 or 32
    (the partial last word), ties (small integers: the first allowed index must win), a NaN
    allowed and a NaN masked, rows with every, no and one token allowed, +inf allowed, and a
    bitmask wider than ceil(V / 32) (its extra words ignored)."""
    rng = np.random.default_rng(3)

    def bits(rows: int, words: int) -> np.ndarray:
        return rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)

    big = (rng.standard_normal((5, 4099)) * 8).astype(np.float32), bits(5, 129)
    ties = rng.integers(-3, 4, size=(4, 77)).astype(np.float32), bits(4, 3)
    x, m = rng.standard_normal((6, 45)).astype(np.float32), bits(6, 4)
    x[0, 7] = np.nan  # allowed below
    m[0, 0] |= 1 << 7
    x[1, 9] = np.nan  # masked below: -inf, no NaN
    m[1, 0] &= ~(1 << 9)
    m[2], m[3] = -1, 0  # every token, none (argmax 0)
    m[4] = 0
    m[4, 1] = 1 << 3  # token 35 only
    x[5, 40] = np.inf
    m[5, 1] |= 1 << 8
    return [big, ties, (x, m), (rng.standard_normal((2, 5)).astype(np.float32), bits(2, 1))]


def token_mask_reference(x: np.ndarray, bitmask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x where bit t % 32 of word t // 32 is set, -inf elsewhere; and its argmax (the first index
    of the maximum, a NaN counting as the maximum)."""
    shifts = np.arange(32, dtype=np.int64)
    allowed = ((bitmask.astype(np.int64)[:, :, None] >> shifts) & 1).reshape(len(x), -1)
    out = np.where(allowed[:, : x.shape[1]] != 0, x, -np.inf).astype(np.float32)
    return out, first_argmax(out)
