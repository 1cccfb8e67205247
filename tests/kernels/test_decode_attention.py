"""The fused decode kernel (kernels_pallas/decode_attention.py): write_kv then attention in one
Pallas kernel, against the float64 oracle (interpret mode, every machine) and against the jnp
reference's write then attend in each model dtype, with an fp8 cache, a sliding window, a soft
cap, KV splits, padding sequences and a slot of -1; lowered for an NVIDIA GPU it is one Triton
call with no host-syncing op around it. Triton's compile and a run need a GPU (marked `gpu`)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.kernels_pallas.decode_attention import decode_attention_with_kv_write, supports
from pagedjax.kernels_pallas.ragged_paged_attention import TRITON_CALL_TARGETS
from pagedjax.kernels_pallas.reference import (
    ragged_paged_attention_reference,
    write_kv_reference,
)
from tests.kernels.naive import per_row_relative_error
from tests.kernels.test_pallas_attention import _float64
from tests.kernels.test_pallas_lowering import _HOST_SYNCING_OPS, _lower_for_cuda

_BOUNDS = {"float32": 1e-5, "bfloat16": 2e-2}


def decode_case(rng: np.random.Generator, kv_lens: list[int], *, num_padding: int = 0,
                num_q_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 16,
                block_size: int = 4, dtype=np.float32) -> dict:
    """The engine's decode layout: sequence s's query at row s, then padding sequences (no
    query, kv_len 0, slot -1); random caches, permuted block tables with one spare block each,
    and the new tokens' slots at position kv_len - 1."""
    num_seqs = len(kv_lens) + num_padding
    max_blocks = max(-(-kv // block_size) for kv in kv_lens) + 1
    num_blocks = num_seqs * max_blocks + 2
    tables = rng.permutation(num_blocks)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    lens = np.array(kv_lens + [0] * num_padding, np.int32)
    slots = np.array([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                      for s, n in enumerate(kv_lens)] + [-1] * num_padding, np.int32)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    return dict(
        q=rng.standard_normal((num_seqs, num_q_heads, head_dim)).astype(dtype),
        k=rng.standard_normal((num_seqs, num_kv_heads, head_dim)).astype(dtype),
        v=rng.standard_normal((num_seqs, num_kv_heads, head_dim)).astype(dtype),
        k_cache=rng.standard_normal(cache_shape).astype(dtype),
        v_cache=rng.standard_normal(cache_shape).astype(dtype),
        slot_mapping=slots, kv_lens=lens, block_tables=tables.astype(np.int32),
        query_start_loc=np.concatenate([[0], np.arange(1, len(kv_lens) + 1),
                                        np.full(num_padding, len(kv_lens))]).astype(np.int32),
    )


def reference(case: dict, **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """write_kv_reference, then ragged_paged_attention_reference: (out, k_cache, v_cache)."""
    a = {name: jnp.asarray(x) for name, x in case.items()}
    scales = {name: kw[name] for name in ("k_scale", "v_scale") if name in kw}
    k_cache, v_cache = write_kv_reference(a["k"], a["v"], a["k_cache"], a["v_cache"],
                                          a["slot_mapping"], **scales)
    out = ragged_paged_attention_reference(a["q"], k_cache, v_cache, a["kv_lens"],
                                           a["block_tables"], a["query_start_loc"], **kw)
    return np.asarray(out), np.asarray(k_cache), np.asarray(v_cache)


def fused(case: dict, **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = {name: jnp.asarray(x) for name, x in case.items()}
    out, k_cache, v_cache = decode_attention_with_kv_write(**a, interpret=True, **kw)
    return np.asarray(out), np.asarray(k_cache), np.asarray(v_cache)


CASES = {  # chunks of 1-2 pages of 4 keys, so that a sequence spans several
    "plain": dict(kv_lens=[5, 1, 13, 31], num_padding=2, num_kv_pages_per_chunk=2),
    "splits": dict(kv_lens=[37, 9, 64], num_splits=3, num_kv_pages_per_chunk=2),
    "window": dict(kv_lens=[30, 7, 19], sliding_window=6, num_kv_pages_per_chunk=1),
    "soft_cap": dict(kv_lens=[11, 26], soft_cap=5.0, num_padding=1),
    "group_1": dict(kv_lens=[9, 17], num_q_heads=2),
    "group_3": dict(kv_lens=[12, 25], num_q_heads=6, num_kv_pages_per_chunk=2),  # rows padded
    "group_16_d_64": dict(kv_lens=[21, 3], num_q_heads=32, head_dim=64, block_size=8),
}


def _split(name: str) -> tuple[dict, dict]:
    """(decode_case's arguments, the kernels' keywords) of one of CASES."""
    case = dict(CASES[name])
    kw = {key: case.pop(key) for key in ("num_splits", "sliding_window", "soft_cap",
                                         "num_kv_pages_per_chunk") if key in case}
    return case, kw


@pytest.mark.parametrize("name", CASES)
def test_float64_equals_write_then_attend(name):
    case_args, kw = _split(name)
    with _float64():
        case = decode_case(np.random.default_rng(len(name)), **case_args, dtype=np.float64)
        sm_scale = case["q"].shape[-1] ** -0.5
        tiling = {key: kw.pop(key) for key in ("num_splits", "num_kv_pages_per_chunk")
                  if key in kw}
        ref_out, ref_k, ref_v = reference(case, sm_scale=sm_scale, **kw)
        out, k_cache, v_cache = fused(case, sm_scale=sm_scale, **tiling, **kw)
    assert per_row_relative_error(out, ref_out) < 1e-10
    num_real = int(case["query_start_loc"][-1])
    assert not out[num_real:].any()  # padding sequences: zeros
    np.testing.assert_array_equal(k_cache, ref_k)  # the slots written, nothing else
    np.testing.assert_array_equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_dtypes_within_their_rounding(dtype):
    case = decode_case(np.random.default_rng(3), [40, 6, 17], num_padding=1, num_q_heads=8,
                       num_kv_heads=2, head_dim=32, block_size=8)
    case = {name: (x.astype(jnp.dtype(dtype)) if x.dtype == np.float32 else x)
            for name, x in case.items()}
    ref_out, ref_k, _ = reference(case, sm_scale=0.2)
    out, k_cache, _ = fused(case, sm_scale=0.2, num_splits=2)
    assert per_row_relative_error(out[:3], ref_out[:3]) < _BOUNDS[dtype]
    np.testing.assert_array_equal(np.asarray(k_cache, np.float32), np.asarray(ref_k, np.float32))


def test_an_fp8_cache_stores_and_reads_as_the_reference():
    """float8_e4m3fn pages: the new token stored as k / k_scale (saturated), attention reading
    cache * scale, the new token's own contribution included at its stored value."""
    case = decode_case(np.random.default_rng(4), [23, 8], num_padding=1, head_dim=16)
    case["k"][0, 0, 0] = 1e4  # saturates at +448 * k_scale
    for name in ("k_cache", "v_cache"):
        case[name] = np.asarray(jnp.asarray(case[name] / 0.5).astype(jnp.float8_e4m3fn))
    kw = dict(sm_scale=0.25, k_scale=0.5, v_scale=0.25)
    ref_out, ref_k, ref_v = reference(case, **kw)
    out, k_cache, v_cache = fused(case, **kw)
    assert per_row_relative_error(out[:2], ref_out[:2]) < 1e-5
    np.testing.assert_array_equal(k_cache.astype(np.float32), ref_k.astype(np.float32))
    np.testing.assert_array_equal(v_cache.astype(np.float32), ref_v.astype(np.float32))


def test_a_slot_of_minus_one_writes_nothing():
    case = decode_case(np.random.default_rng(5), [9, 14])
    case["slot_mapping"][1] = -1
    _, k_cache, v_cache = fused(case, sm_scale=0.3)
    block, offset = divmod(int(case["slot_mapping"][0]), 4)
    np.testing.assert_array_equal(k_cache[block, :, offset], case["k"][0])
    untouched = np.ones(k_cache.shape[0] * k_cache.shape[2], bool)
    untouched[int(case["slot_mapping"][0])] = False
    flat = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, *c.shape[1:2], c.shape[3])  # noqa: E731
    np.testing.assert_array_equal(flat(k_cache)[untouched], flat(case["k_cache"])[untouched])
    np.testing.assert_array_equal(flat(v_cache)[untouched], flat(case["v_cache"])[untouched])


def test_shapes_it_declines():
    assert supports(32, 8, 64) and supports(8, 8, 128) and supports(9, 3, 64)  # any group
    assert supports(64, 2, 64)  # a group of 32: 32 rows
    assert not supports(32, 8, 80) and not supports(12, 8, 64)  # D = 80; heads not in groups
    case = decode_case(np.random.default_rng(6), [5], num_q_heads=4, num_kv_heads=2,
                       head_dim=24)
    with pytest.raises(ValueError, match="head_dim 24"):
        fused(case, sm_scale=1.0)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_lowers_for_cuda_to_one_triton_call(num_splits, dtype):
    """The 1B shape (32 query heads over 8 KV heads of 64, block 16) at batch 8, a bf16 or an
    fp8 cache."""
    s, n = 8, 64
    struct = jax.ShapeDtypeStruct
    args = dict(q=struct((s, 32, 64), jnp.bfloat16), k=struct((s, 8, 64), jnp.bfloat16),
                v=struct((s, 8, 64), jnp.bfloat16), k_cache=struct((n, 8, 16, 64), dtype),
                v_cache=struct((n, 8, 16, 64), dtype), slot_mapping=struct((s,), jnp.int32),
                kv_lens=struct((s,), jnp.int32), block_tables=struct((s, 32), jnp.int32),
                query_start_loc=struct((s + 1,), jnp.int32))
    fn = functools.partial(decode_attention_with_kv_write, sm_scale=0.125, interpret=False,
                           num_splits=num_splits)
    hlo = _lower_for_cuda(fn, **args)
    calls = sum(len(re.findall(rf'custom_call @"?{re.escape(target)}"?\(', hlo))
                for target in TRITON_CALL_TARGETS)
    assert calls == 1, hlo
    assert not _HOST_SYNCING_OPS.search(hlo)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["plain", "splits", "window"])
def test_on_a_gpu_it_equals_write_then_attend(name):
    case_args, kw = _split(name)
    kw.pop("num_kv_pages_per_chunk", None)  # Triton: 16 keys a chunk at least, its own choice
    case = decode_case(np.random.default_rng(7), **case_args, dtype=np.float32)
    a = {key: jnp.asarray(x) for key, x in case.items()}
    out, k_cache, _ = decode_attention_with_kv_write(**a, sm_scale=0.25, **kw)
    kw.pop("num_splits", None)
    ref_out, ref_k, _ = reference(case, sm_scale=0.25, **kw)
    assert per_row_relative_error(np.asarray(out), ref_out) < 1e-5
    np.testing.assert_array_equal(np.asarray(k_cache), ref_k)
