"""The jnp attention (tiled, the JAX backend's CPU path; and the reference) against the
float64 oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.backends.jax import cpu_ffi
from pagedjax.backends.jax.attention import ragged_paged_attention_cpu
from pagedjax.kernels_pallas.reference import ragged_paged_attention_reference
from pagedjax.kernels_pallas.tiled_attention import ragged_paged_attention_tiled
from tests.kernels.naive import (
    make_ragged_case,
    naive_ragged_paged_attention,
    per_row_relative_error,
    soft_cap_effect,
)

_BOUNDS = {np.float32: 1e-5, jnp.bfloat16: 2e-2}


def _run(case: dict, impl=ragged_paged_attention_tiled, **kwargs) -> np.ndarray:
    fn = jax.jit(functools.partial(impl, **kwargs))
    out = fn(**{name: jnp.asarray(value) for name, value in case.items()})
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    return np.asarray(out.astype(jnp.float32), np.float64)


def _check(case: dict, bound: float, impl=ragged_paged_attention_tiled, **kwargs) -> None:
    oracle_kwargs = {k: v for k, v in kwargs.items()
                     if k in ("sm_scale", "sliding_window", "soft_cap")}
    ref = naive_ragged_paged_attention(**case, **oracle_kwargs)
    out = _run(case, impl, **kwargs)
    num_valid = int(case["query_start_loc"][-1])
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[num_valid:], 0.0)  # padding rows
    assert per_row_relative_error(out, ref) <= bound


@pytest.mark.parametrize("rows_per_tile,chunk_blocks", [(4, 1), (16, 8), (32, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_batch(rows_per_tile: int, chunk_blocks: int, block_size: int) -> None:
    """Decodes, a prefill, a chunk over a cached prefix, q_len-0 and padding sequences; tiles
    that straddle nothing, one row, and many chunks of KV."""
    rng = np.random.default_rng(block_size + rows_per_tile)
    q_lens = [1, 1, 37, 0, 5, 0]
    kv_lens = [block_size + 1, 1, 37, block_size, 6 * block_size + 3, 0]
    case = make_ragged_case(rng, q_lens, kv_lens, num_q_heads=8, num_kv_heads=2, head_dim=32,
                            block_size=block_size, num_padding_rows=3)
    _check(case, 1e-5, sm_scale=0.17, rows_per_tile=rows_per_tile, chunk_blocks=chunk_blocks)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_decode_path(dtype) -> None:
    """decode=True: one query per sequence (T == S), padding sequences included."""
    rng = np.random.default_rng(1)
    kv_lens = [1, 15, 16, 17, 130, 0, 0, 0]
    q_lens = [1] * 5 + [0] * 3
    case = make_ragged_case(rng, q_lens, kv_lens, num_q_heads=4, num_kv_heads=1, head_dim=64,
                            block_size=16, num_padding_rows=3, dtype=dtype)
    _check(case, _BOUNDS[dtype], sm_scale=0.125, decode=True)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 2.0), (20, 3.0)])
def test_sliding_window_and_soft_cap(window: int | None, cap: float | None) -> None:
    """A decode, a prefill and a chunk over a prefix; the tiled version and the reference."""
    rng = np.random.default_rng(2)
    case = make_ragged_case(rng, [1, 9, 24], [40, 9, 70], num_q_heads=6, num_kv_heads=3,
                            head_dim=16, block_size=8, num_padding_rows=2)
    semantics = dict(sm_scale=0.25, sliding_window=window, soft_cap=cap)
    if cap is not None:
        assert soft_cap_effect(case, **semantics) > 0.1
    _check(case, 1e-5, **semantics, rows_per_tile=8, chunk_blocks=2)
    _check(case, 1e-5, ragged_paged_attention_reference, **semantics)


def test_decode_needs_one_row_per_sequence() -> None:
    case = make_ragged_case(np.random.default_rng(3), [2], [4], num_q_heads=2, num_kv_heads=1,
                            head_dim=8, block_size=8)
    with pytest.raises(ValueError, match="decode=True needs one query row per sequence"):
        _run(case, sm_scale=1.0, decode=True)


@pytest.mark.parametrize("q_lens,kv_lens", [([1] * 4, [9, 40, 1, 17]),  # decode: the loop
                                            ([100, 1, 30], [130, 50, 30])])  # tiled (T >= 128)
def test_cpu_dispatch(q_lens: list[int], kv_lens: list[int], monkeypatch) -> None:
    """The jnp versions, as they serve where the C++ kernel (tests/kernels/test_cpu_ffi.py)
    cannot be built."""
    monkeypatch.setattr(cpu_ffi, "available", lambda: False)
    rng = np.random.default_rng(4)
    decode = max(q_lens) == 1
    case = make_ragged_case(rng, q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=16,
                            block_size=16, num_padding_rows=0 if decode else 2)
    _check(case, 1e-5, ragged_paged_attention_cpu, sm_scale=0.25, decode=decode)
