"""Pallas ragged paged attention against the float64 oracle and the jnp reference.

- float64 tests run in interpret mode on the CPU device, on every machine (Triton has no useful
  float64 path). Interpret mode fills pallas_call outputs with NaN before the kernel runs, so a
  tile or split the kernel skips shows up as NaN.
- `test_configs` runs `gpu_configs.TEST_CONFIGS` (float32/bf16/fp16, tiles valid for Triton):
  interpreted on CPU, compiled on a GPU, with a tolerance per dtype and NaN in every cache slot
  outside the contexts.
- Tests marked `gpu` need one and are deselected by default; on a GPU machine run
  `python -m pytest -m "gpu or not gpu" tests/kernels` (or `make gpu-check`).

Every test asserts no NaN anywhere and exact zeros on padding rows. Shapes are tiny; each distinct
shape compiles once, without LLVM optimisation on CPU, to keep the file fast.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pagedjax.kernels_pallas import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv,
)
from pagedjax.kernels_pallas.ragged_paged_attention import TRITON_CALL_TARGETS
from pagedjax.kernels_pallas.reference import write_kv_reference
from tests.kernels.gpu_configs import TEST_CONFIGS, KernelConfig
from tests.kernels.naive import (
    make_ragged_case,
    naive_ragged_paged_attention,
    per_row_relative_error,
    soft_cap_effect,
)

# Interpret-mode results do not depend on these; they cut XLA:CPU compile time about 3x.
_FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
_F64_BOUND = 1e-10  # float64 inputs: only reassociation error is left
# Per-row relative error against the oracle of the same rounded inputs. float32 at 1e-5 also
# proves HIGHEST precision on a GPU: TF32 products (10-bit mantissa) miss it by ~100x.
_BOUNDS = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
_INTERPRET = dict(interpret=True)  # float64 cases: interpret mode on every machine


@contextlib.contextmanager
def _float64():
    """x64 on, and the CPU as the default device (float64 runs interpreted there)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def x64():
    """Float64 for the duration of one test."""
    with _float64():
        yield


@functools.cache
def _fast_compile_options() -> dict:
    """The subset of _FAST_COMPILE this jaxlib knows (XLA renames and drops options)."""
    options = dict(_FAST_COMPILE)
    while True:
        try:
            jax.jit(lambda x: x + 1).lower(1.0).compile(options)
            return options
        except jax.errors.JaxRuntimeError as error:
            unknown = re.search(r"No such compile option: '(\w+)'", str(error))
            if unknown is None:
                raise
            del options[unknown[1]]


@functools.cache
def _compiled(signature: tuple, x64: bool, platform: str) -> Callable:
    """One program running the op on every (arg shapes, kwargs) in signature.

    x64 and platform only key the cache: the program is traced in the current mode, for the
    current default device. On CPU it compiles cheaply (no LLVM optimisation).
    """
    kwargs = [dict(kw) for _, kw in signature]
    args = [{name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in arg_sig}
            for arg_sig, _ in signature]

    def run(args: list[dict]) -> list[jax.Array]:
        return [ragged_paged_attention(**a, **kw) for a, kw in zip(args, kwargs, strict=True)]

    return jax.jit(run).lower(args).compile(_fast_compile_options() if platform == "cpu" else None)


def _attention_many(calls: list[tuple[dict, dict]]) -> list[np.ndarray]:
    """Run the public op on each (case, kwargs) in one program; each [T, Hq, D] as float64.

    One program for several shapes compiles about twice as fast as one program per shape.
    """
    args = [{name: jnp.asarray(value) for name, value in case.items()} for case, _ in calls]
    signature = tuple(
        (tuple((name, a.shape, a.dtype) for name, a in arg.items()), tuple(sorted(kw.items())))
        for arg, (_, kw) in zip(args, calls, strict=True)
    )
    platform = args[0]["q"].devices().pop().platform
    outs = _compiled(signature, jax.config.jax_enable_x64, platform)(args)
    for out, a in zip(outs, args, strict=True):
        assert out.dtype == a["q"].dtype and out.shape == a["q"].shape
    return [np.asarray(out).astype(np.float64) for out in outs]


def _attention(case: dict, **kwargs) -> np.ndarray:
    return _attention_many([(case, kwargs)])[0]


def _assert_close(
    out: np.ndarray, case: dict, bound: float, label: str = "", **attention_kwargs
) -> None:
    """No NaN, padding rows exactly zero, valid rows within `bound` of the float64 oracle."""
    ref = naive_ragged_paged_attention(**case, **attention_kwargs)
    assert not np.isnan(out).any(), f"{label}: unwritten or NaN rows"
    num_valid = int(case["query_start_loc"][-1])
    np.testing.assert_array_equal(out[num_valid:], 0.0, err_msg=f"{label}: padding rows")
    error = per_row_relative_error(out, ref)
    assert error <= bound, f"{label}: per-row relative error {error:.3g} > {bound:.3g}"


def _case(rng, q_lens, kv_lens, *, group, head_dim, block_size, padding_rows=2, dtype=np.float64):
    num_kv_heads = 2 if group <= 2 else 1
    return make_ragged_case(
        rng, q_lens, kv_lens, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_padding_rows=padding_rows, dtype=dtype,
    )


def _boundary_lens(block_size: int) -> tuple[list[int], list[int]]:
    """Mixed batch: decodes, a prefill without prefix, a chunk over a prefix, q_len-0 sequences.

    Context lengths 1, bs-1, bs, bs+1 and the maximum (4 pages, the last one partial).
    """
    longest = 3 * block_size + 3
    kv_lens = [block_size + 1, 1, block_size - 1, block_size, longest, 0]
    q_lens = [1, 1, block_size - 1, 0, 5, 0]
    return q_lens, kv_lens


_HEAD_DIMS = (64, 80, 96, 128, 256)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_multi_token_grid(x64, block_size, group):
    """Every head_dim for each (block_size, group): mixed batch through the multi-token path."""
    rng = np.random.default_rng(block_size * 10 + group)
    q_lens, kv_lens = _boundary_lens(block_size)
    cases = [_case(rng, q_lens, kv_lens, group=group, head_dim=head_dim, block_size=block_size)
             for head_dim in _HEAD_DIMS]
    kwargs = dict(sm_scale=0.125, rows_per_tile=8, num_kv_pages_per_chunk=2, **_INTERPRET)
    outs = _attention_many([(case, kwargs) for case in cases])
    for head_dim, case, out in zip(_HEAD_DIMS, cases, outs, strict=True):
        _assert_close(out, case, _F64_BOUND, f"head_dim={head_dim}", sm_scale=0.125)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_grid(x64, block_size, group):
    """T == S: both paths on a decode batch (one padding sequence and row); decode=True is the
    one-tile-per-sequence path. Head dims rotate: their handling is tested on the grid above."""
    head_dim = _HEAD_DIMS[(block_size // 8 + group) % 5]
    rng = np.random.default_rng(block_size * 10 + group)
    _, kv_lens = _boundary_lens(block_size)
    q_lens = [1, 1, 1, 1, 1, 0]  # T = S = 6: five decodes, one padding row
    case = _case(rng, q_lens, kv_lens, group=group, head_dim=head_dim, block_size=block_size,
                 padding_rows=1)
    calls = [(case, dict(sm_scale=0.3, num_kv_pages_per_chunk=1, decode=decode, **_INTERPRET))
             for decode in (True, False)]
    for decode, out in zip((True, False), _attention_many(calls), strict=True):
        _assert_close(out, case, _F64_BOUND, f"decode={decode}", sm_scale=0.3)


def _poison_outside_contexts(case: dict) -> None:
    """NaN in every cache slot that holds no sequence's context (in place)."""
    block_size = case["k_cache"].shape[2]
    owned = np.zeros(case["k_cache"].shape[0] * block_size, bool)
    for table, kv_len in zip(case["block_tables"], case["kv_lens"], strict=True):
        slots = np.arange(kv_len)
        owned[table[slots // block_size] * block_size + slots % block_size] = True
    owned = owned.reshape(-1, 1, block_size, 1)  # broadcast over heads and head_dim
    for name in ("k_cache", "v_cache"):
        case[name] = np.where(owned, case[name], np.nan).astype(case[name].dtype)


def _config_case(config: KernelConfig) -> dict:
    """The config's inputs rounded to its dtype, NaN outside every context."""
    case = config.numpy_case()
    _poison_outside_contexts(case)
    for name in ("q", "k_cache", "v_cache"):
        case[name] = case[name].astype(jnp.dtype(config.dtype))
    return case


@pytest.mark.parametrize("config", TEST_CONFIGS, ids=lambda c: c.name)
def test_configs(config: KernelConfig):
    """The Triton-valid configurations: interpreted on CPU, compiled on a GPU (interpret=None)."""
    case = _config_case(config)
    out = _attention(case, sm_scale=config.head_dim**-0.5, **config.kwargs)
    semantics = {k: v for k, v in config.kwargs.items()
                 if k in ("sliding_window", "soft_cap")}
    _assert_close(out, case, _BOUNDS[config.dtype], config.name,
                  sm_scale=config.head_dim**-0.5, **semantics)


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_sliding_window_and_soft_cap(x64, soft_cap):
    """Windows of one key, a page, a page + 1 and longer than every context; with KV splits."""
    rng = np.random.default_rng(1)
    q_lens, kv_lens = _boundary_lens(8)
    case = _case(rng, q_lens, kv_lens, group=2, head_dim=64, block_size=8)
    windows = (1, 8, 9, 100)
    if soft_cap is not None:  # window 1 leaves one key: there the cap cannot matter
        assert soft_cap_effect(case, sm_scale=0.5, sliding_window=9, soft_cap=soft_cap) > 0.1
    calls = [(case, dict(sm_scale=0.5, sliding_window=w, soft_cap=soft_cap))
             for w in windows]
    outs = _attention_many([(c, dict(kw, rows_per_tile=4, num_kv_pages_per_chunk=1,
                                      num_splits=2, **_INTERPRET)) for c, kw in calls])
    for window, (case, kwargs), out in zip(windows, calls, outs, strict=True):
        _assert_close(out, case, _F64_BOUND, f"window={window}", **kwargs)


@pytest.mark.parametrize("decode", [True, False])
def test_split_k(x64, decode):
    """KV splits merged by log-sum-exp, including more splits than chunks (empty splits)."""
    rng = np.random.default_rng(2)
    q_lens, kv_lens = ([1, 1, 1, 0], [130, 1, 33, 0]) if decode else ([1, 6, 2, 0], [130, 6, 33, 0])
    case = _case(rng, q_lens, kv_lens, group=4, head_dim=64, block_size=8, padding_rows=1)
    splits = (2, 3, 16)
    kwargs = dict(sm_scale=0.2, sliding_window=70)
    outs = _attention_many([(case, dict(kwargs, num_splits=n, num_kv_pages_per_chunk=2,
                                        decode=decode, **_INTERPRET)) for n in splits])
    for num_splits, out in zip(splits, outs, strict=True):
        _assert_close(out, case, _F64_BOUND, f"num_splits={num_splits}", **kwargs)


def test_tiling_knobs(x64):
    """Tiles smaller than a group, tiles straddling tokens (G = 3), chunks past the table."""
    rng = np.random.default_rng(4)
    case = _case(rng, [4, 9, 1], [4, 30, 17], group=3, head_dim=64, block_size=8)
    knobs = [(1, 1), (2, 4), (16, 1), (64, 4)]
    outs = _attention_many([(case, dict(sm_scale=0.4, rows_per_tile=rows, **_INTERPRET,
                                        num_kv_pages_per_chunk=pages)) for rows, pages in knobs])
    for (rows, pages), out in zip(knobs, outs, strict=True):
        _assert_close(out, case, _F64_BOUND, f"rows={rows} pages={pages}", sm_scale=0.4)


def test_matches_jnp_reference():
    """The kernel (compiled on a GPU) and the reference (decode accepted, ignored) agree."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = _boundary_lens(16)
    case = _case(rng, q_lens, kv_lens, group=4, head_dim=80, block_size=16, dtype=np.float32)
    kwargs = dict(sm_scale=0.1, sliding_window=20, soft_cap=5.0)
    out = _attention(case, **kwargs)
    ref = ragged_paged_attention_reference(**{k: jnp.asarray(v) for k, v in case.items()},
                                           **kwargs, decode=True)
    assert per_row_relative_error(out, np.asarray(ref)) <= 1e-5


@pytest.mark.parametrize("decode", [True, False])
def test_garbage_outside_the_context_never_leaks(x64, decode):
    """inf/NaN in spare blocks and past each context, out-of-range ids in unused table entries."""
    rng = np.random.default_rng(11)
    q_lens, kv_lens = ([1, 1, 0], [9, 24, 0]) if decode else ([3, 1, 0], [9, 24, 0])
    case = _case(rng, q_lens, kv_lens, group=2, head_dim=64, block_size=8,
                 padding_rows=1 if decode else 2)
    used = np.zeros(case["k_cache"].shape[0] * 8, bool)  # slots holding a context's keys
    for s, kv_len in enumerate(kv_lens):
        slots = np.arange(kv_len)
        used[case["block_tables"][s, slots // 8] * 8 + slots % 8] = True
        case["block_tables"][s, -(-kv_len // 8):] = [-7, 10**6, 3 * 10**9 % 2**31][s]
    for name, poison in (("k_cache", np.inf), ("v_cache", np.nan)):
        flat = case[name].transpose(0, 2, 1, 3).reshape(used.size, -1).copy()  # [N*bs, Hkv*D]
        flat[~used] = poison
        case[name] = flat.reshape(-1, 8, *case[name].shape[1::2]).transpose(0, 2, 1, 3)
    out = _attention(case, sm_scale=0.3, num_kv_pages_per_chunk=4, num_splits=2, decode=decode,
                     **_INTERPRET)
    _assert_close(out, case, _F64_BOUND, sm_scale=0.3)


def test_decode_flag(x64):
    """T == S does not imply q_len <= 1 (q_lens 2, 0, 1): decode=False serves it; decode=True
    with T != S is an error that names the shapes."""
    rng = np.random.default_rng(5)
    case = _case(rng, [2, 0, 1], [5, 3, 12], group=2, head_dim=64, block_size=8, padding_rows=0)
    out = _attention(case, sm_scale=0.3, **_INTERPRET)
    _assert_close(out, case, _F64_BOUND, sm_scale=0.3)
    case["q"] = np.concatenate([case["q"], case["q"][:1]])  # T = 4, S = 3
    with pytest.raises(ValueError, match=r"decode=True .*\(4, 4, 64\).*\(3,\)"):
        ragged_paged_attention(**case, sm_scale=0.3, decode=True)


def test_all_padding_gives_zeros():
    """No query at all: T == S through both paths, and T > S."""
    rng = np.random.default_rng(0)
    cases = [_case(rng, [0, 0, 0], [0, 5, 0], group=2, head_dim=64, block_size=8,
                   padding_rows=num_tokens, dtype=np.float32) for num_tokens in (3, 3, 4)]
    calls = [(case, dict(sm_scale=1.0, decode=decode))
             for case, decode in zip(cases, (True, False, False), strict=True)]
    for out in _attention_many(calls):
        np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_lens=np.zeros(3, np.float32)), "int32"),
        (dict(q=np.zeros((4, 3, 64), np.float32)), "multiple of Hkv"),
        (dict(query_start_loc=np.zeros(3, np.int32)), r"\[S\+1\]"),
        (dict(k_cache=np.zeros((5, 2, 12, 64), np.float32)), "power of two"),
    ],
)
def test_invalid_inputs_raise(change, message):
    case = _case(np.random.default_rng(0), [1, 2, 1], [3, 4, 5], group=2, head_dim=64,
                 block_size=8, padding_rows=0, dtype=np.float32)
    case.update(change)
    if "k_cache" in change:
        case["v_cache"] = change["k_cache"]
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(**case, sm_scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        ragged_paged_attention(**_case(np.random.default_rng(0), [1, 2], [3, 4], group=2,
                                       head_dim=64, block_size=8, dtype=np.float32),
                               sm_scale=1.0, rows_per_tile=12)


def test_write_kv_matches_reference():
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.float32) for _ in range(2))
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((4, 2, 8, 64)), jnp.float32)
                        for _ in range(2))
    slots = jnp.asarray([3, -1, 8 * 3 + 7, 0, -1], jnp.int32)
    expected = write_kv_reference(k, v, k_cache, v_cache, slots)
    got = write_kv(k, v, k_cache, v_cache, slots)  # donates (consumes) the caches
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_PROPERTY_SHAPE = dict(num_tokens=12, max_pages=6, block_size=8)  # one compile per property


def _fixed_shape_case(seed: int, q_lens: list[int], kv_lens: list[int]) -> dict:
    """Random ragged batch in fixed shapes: [T, 4, 64] queries, 2 KV heads, 6 pages per row."""
    rng = np.random.default_rng(seed)
    num_tokens, max_pages, block_size = _PROPERTY_SHAPE.values()
    num_seqs, num_blocks = len(kv_lens), len(kv_lens) * max_pages + 2
    cache_shape = (num_blocks, 2, block_size, 64)
    return dict(
        q=rng.standard_normal((num_tokens, 4, 64)),
        k_cache=rng.standard_normal(cache_shape),
        v_cache=rng.standard_normal(cache_shape),
        kv_lens=np.asarray(kv_lens, np.int32),
        block_tables=rng.permutation(num_blocks)[: num_seqs * max_pages]
        .reshape(num_seqs, max_pages).astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
    )


_SEQS = st.lists(st.tuples(st.integers(0, 48), st.integers(0, 48)), min_size=4, max_size=4)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seqs=_SEQS, seed=st.integers(0, 2**32 - 1))
def test_property_multi_token(seqs, seed):
    """Any ragged mix that fits T = 12 tokens: general path, window 13, soft cap."""
    kv_lens, q_lens, budget = [], [], _PROPERTY_SHAPE["num_tokens"]
    for kv_len, q_len in seqs:
        q_lens.append(min(q_len, kv_len, budget))
        kv_lens.append(kv_len)
        budget -= q_lens[-1]
    case = _fixed_shape_case(seed, q_lens, kv_lens)
    kwargs = dict(sm_scale=0.3, sliding_window=13, soft_cap=4.0)
    with _float64():
        out = _attention(case, rows_per_tile=4, num_kv_pages_per_chunk=2, **kwargs, **_INTERPRET)
    _assert_close(out, case, _F64_BOUND, **kwargs)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seqs=_SEQS, seed=st.integers(0, 2**32 - 1))
def test_property_decode(seqs, seed):
    """T == S == 4, each q_len 0 or 1 (padding rows fill T): the decode path with 2 KV splits."""
    kv_lens = [kv_len for kv_len, _ in seqs]
    q_lens = [int(kv_len > 0 and q_len % 2 == 1) for kv_len, q_len in seqs]
    case = _fixed_shape_case(seed, q_lens, kv_lens)
    case["q"] = case["q"][:4]
    with _float64():
        out = _attention(case, sm_scale=0.3, num_splits=2, num_kv_pages_per_chunk=1, decode=True,
                         **_INTERPRET)
    _assert_close(out, case, _F64_BOUND, sm_scale=0.3)


def _compiled_on_gpu(case: dict, **kwargs) -> np.ndarray:
    """interpret=False on the GPU, after checking the program holds the Triton kernel."""
    args = {name: jnp.asarray(value) for name, value in case.items()}
    fn = jax.jit(functools.partial(ragged_paged_attention, interpret=False, **kwargs))
    hlo = fn.lower(**args).as_text()
    assert any(target in hlo for target in TRITON_CALL_TARGETS), "no Triton call in the HLO"
    return np.asarray(fn(**args)).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("config", TEST_CONFIGS, ids=lambda c: c.name)
def test_compiled_triton_kernel_on_gpu(jax_gpu, config: KernelConfig):
    case = _config_case(config)
    out = _compiled_on_gpu(case, sm_scale=config.head_dim**-0.5, **config.kwargs)
    semantics = {k: v for k, v in config.kwargs.items()
                 if k in ("sliding_window", "soft_cap")}
    _assert_close(out, case, _BOUNDS[config.dtype], config.name,
                  sm_scale=config.head_dim**-0.5, **semantics)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False])
def test_benchmark_decode_shape_on_gpu(jax_gpu, decode):
    """The kernel benchmark's headline case: B = 64, context 2048, GQA 32/8, D 128, bf16."""
    rng = np.random.default_rng(0)
    case = make_ragged_case(rng, [1] * 64, [2048] * 64, num_q_heads=32, num_kv_heads=8,
                            head_dim=128, block_size=16)
    _poison_outside_contexts(case)
    for name in ("q", "k_cache", "v_cache"):
        case[name] = case[name].astype(jnp.bfloat16)
    out = _compiled_on_gpu(case, sm_scale=128**-0.5, decode=decode)
    _assert_close(out, case, _BOUNDS["bfloat16"], sm_scale=128**-0.5)
