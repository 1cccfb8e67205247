"""The C++ CPU attention through XLA's FFI (the JAX backend's float32 CPU path) against the
float64 oracle, its errors, and the jnp fallback where it cannot be built."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.backends.jax import cpu_ffi
from pagedjax.backends.jax.attention import ragged_paged_attention_cpu
from tests.kernels.naive import (
    logits_stats_cases,
    logits_stats_reference,
    make_ragged_case,
    naive_ragged_paged_attention,
    per_row_relative_error,
    soft_cap_effect,
)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_ffi.available(), "the FFI library must build on the test machines (g++ is there)"


def _run(case: dict, fn=cpu_ffi.ragged_paged_attention, **kwargs) -> np.ndarray:
    out = jax.jit(functools.partial(fn, **kwargs))(**{k: jnp.asarray(v) for k, v in case.items()})
    assert out.dtype == jnp.float32 and out.shape == case["q"].shape
    return np.asarray(out, np.float64)


def _check(case: dict, **kwargs) -> None:
    want = naive_ragged_paged_attention(**case, **kwargs)
    got = _run(case, **kwargs)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[int(case["query_start_loc"][-1]):], 0.0)  # padding rows
    assert per_row_relative_error(got, want) <= 1e-5


@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(1, 32, 16), (4, 64, 8), (3, 20, 16), (8, 16, 32)])
def test_mixed_batch(group: int, head_dim: int, block_size: int) -> None:
    """Decodes, a prefill, a chunk over a cached prefix, q_len-0 and padding rows; head_dim 20
    takes the scalar path (no multiple of 8), the others AVX2 where the CPU has it."""
    rng = np.random.default_rng(group * 100 + head_dim)
    case = make_ragged_case(rng, [1, 1, 37, 0, 5, 0],
                            [block_size + 1, 1, 37, block_size, 6 * block_size + 3, 0],
                            num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                            block_size=block_size, num_padding_rows=3)
    _check(case, sm_scale=head_dim**-0.5)


@pytest.mark.parametrize(("window", "cap"), [(1, None), (5, None), (None, 2.0), (20, 3.0)])
def test_sliding_window_and_soft_cap(window: int | None, cap: float | None) -> None:
    case = make_ragged_case(np.random.default_rng(2), [1, 9, 24], [40, 9, 70], num_q_heads=6,
                            num_kv_heads=3, head_dim=16, block_size=8, num_padding_rows=2)
    if cap is not None:  # the cap changes the answer well beyond the bound
        assert soft_cap_effect(case, sm_scale=0.25, sliding_window=window, soft_cap=cap) > 0.1
    _check(case, sm_scale=0.25, sliding_window=window, soft_cap=cap)


def test_the_backends_cpu_attention_takes_it_in_float32() -> None:
    case = make_ragged_case(np.random.default_rng(3), [1] * 4, [9, 40, 1, 17], num_q_heads=4,
                            num_kv_heads=2, head_dim=16, block_size=16)
    args = [jnp.asarray(v) for v in case.values()]
    fn = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=0.25, decode=True))
    assert cpu_ffi.TARGET in fn.lower(*args).as_text()
    bf16 = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args]
    assert cpu_ffi.TARGET not in fn.lower(*bf16).as_text()  # bf16: the jnp versions


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda c: c["block_tables"].fill(10_000), "out of range"),
    (lambda c: c["kv_lens"].__setitem__(0, 0), "q_len=1 > kv_lens"),
    (lambda c: c["query_start_loc"].__setitem__(0, 1), r"query_start_loc\[0\] must be 0"),
])
def test_bad_metadata_raises(mutate, message: str) -> None:
    case = make_ragged_case(np.random.default_rng(4), [1, 3], [5, 9], num_q_heads=2,
                            num_kv_heads=1, head_dim=8, block_size=4)
    mutate(case)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _run(case, sm_scale=1.0)


def test_rejects_other_dtypes() -> None:
    case = make_ragged_case(np.random.default_rng(5), [1], [3], num_q_heads=2, num_kv_heads=1,
                            head_dim=8, block_size=4)
    case["q"] = case["q"].astype(np.float16)
    with pytest.raises(ValueError, match="takes float32 q and float32 or float8_e4m3fn caches; "
                                         "got q float16"):
        _run(case, sm_scale=1.0)


def test_a_failed_build_falls_back_to_jnp_with_one_warning(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    cpu_ffi.available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no-such-compiler"):
            assert not cpu_ffi.available()
        assert not cpu_ffi.available()  # cached: warned once
        case = make_ragged_case(np.random.default_rng(6), [3, 1], [3, 20], num_q_heads=4,
                                num_kv_heads=2, head_dim=16, block_size=8)
        args = [jnp.asarray(v) for v in case.values()]
        fn = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=0.25))
        assert cpu_ffi.TARGET not in fn.lower(*args).as_text()
        want = naive_ragged_paged_attention(**case, sm_scale=0.25)
        assert per_row_relative_error(np.asarray(fn(*args), np.float64), want) <= 1e-5
    finally:
        cpu_ffi.available.cache_clear()


def test_the_build_is_cached_per_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    path = cpu_ffi.library_path()
    assert path.parent == tmp_path and path.name.startswith("jax_ffi_attention_")
    monkeypatch.setenv("CXX", "g++-other")
    assert cpu_ffi.library_path() != path  # another compiler, another build


# ---- the packed linear -------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 64, 40), (7, 96, 72), (64, 256, 512), (5, 48, 16), (0, 32, 16),
                          (20, 64, 576), (33, 576, 960)])
def test_linear_matches_float64(rows: int, in_features: int, out_features: int) -> None:
    """Row groupings (AVX-512: blocks of 4 rows, a last block of 1-7; AVX2: blocks of 6, then
    the last 1-5), tile counts (groups of 4, a partial tile), and two threads' tile ranges that
    do not line up with the groups (36 tiles: 18 + 18) while the next tiles are prefetched."""
    rng = np.random.default_rng(rows + in_features)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    w = rng.standard_normal((in_features, out_features)).astype(np.float32)
    packed = cpu_ffi.pack_linear_weight(jnp.asarray(w))
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    got = jax.jit(lambda x, p: cpu_ffi.linear(x, p, out_features))(jnp.asarray(x), packed)
    assert got.shape == (rows, out_features) and got.dtype == jnp.float32
    scale = np.abs(x).astype(np.float64) @ np.abs(w) + 1.0
    assert np.max(np.abs(np.asarray(got, np.float64) - x.astype(np.float64) @ w) / scale,
                  initial=0.0) < 1e-6


def test_linear_is_the_torch_ops_bit_for_bit_and_batch_invariant() -> None:
    """The same C++ kernel as the torch op (one FMA chain per element in k order): the same bits
    as `pagedjax::linear`, and a row alone equals that row in a batch."""
    torch = pytest.importorskip("torch")
    from pagedjax.kernels_cuda import ops

    rng = np.random.default_rng(3)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    w = rng.standard_normal((256, 200)).astype(np.float32)
    packed = cpu_ffi.pack_linear_weight(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(packed), ops.pack_linear_weight(torch.from_numpy(w)))
    batch = np.asarray(cpu_ffi.linear(jnp.asarray(x), packed, 200))
    np.testing.assert_array_equal(batch, ops.linear(torch.from_numpy(x), ops.pack_linear_weight(
        torch.from_numpy(w)), None, 200).numpy())
    for row in (0, 5, 10):
        np.testing.assert_array_equal(
            np.asarray(cpu_ffi.linear(jnp.asarray(x[row : row + 1]), packed, 200))[0], batch[row])


@pytest.mark.parametrize("num_rows", [0, 1, 6, 11, 20])
def test_linear_computes_the_first_num_rows_only(num_rows: int) -> None:
    """num_rows (a traced int32: the step's real logits rows): those rows as without it, the
    rest zeros; more than the rows there are computes them all."""
    rng = np.random.default_rng(num_rows)
    x = jnp.asarray(rng.standard_normal((11, 64)).astype(np.float32))
    packed = cpu_ffi.pack_linear_weight(jnp.asarray(rng.standard_normal((64, 40)), jnp.float32))
    full = np.asarray(cpu_ffi.linear(x, packed, 40))
    got = np.asarray(jax.jit(lambda x, p, n: cpu_ffi.linear(x, p, 40, n))(
        x, packed, jnp.int32(num_rows)))
    n = min(num_rows, 11)
    np.testing.assert_array_equal(got[:n], full[:n])
    np.testing.assert_array_equal(got[n:], 0)


def test_linear_rejects_other_dtypes() -> None:
    packed = cpu_ffi.pack_linear_weight(jnp.zeros((8, 16)))
    with pytest.raises(ValueError, match="float32"):
        cpu_ffi.linear(jnp.zeros((2, 8), jnp.bfloat16), packed, 16)


def test_the_jax_model_packs_its_linears_only_on_the_cpu_path() -> None:
    """float32 with the C++ attention on one device: packed; the jnp reference, bf16 or a
    tensor-parallel mesh keep XLA's dots (and Flax Dense's [in, out] kernels)."""
    from pagedjax.backends.jax.attention import uses_cpu_linear

    assert uses_cpu_linear("cpu", jnp.float32, None)
    assert not uses_cpu_linear("reference", jnp.float32, None)
    assert not uses_cpu_linear("cpu", jnp.bfloat16, None)
    assert not uses_cpu_linear("cpu", jnp.float32, object())


# ---- top-k (the logprobs' top entries) ---------------------------------------------------------


@pytest.mark.parametrize("k", [1, 7, 20, 40])
def test_top_k_is_lax_top_k(k: int) -> None:
    """Values and indices equal jax.lax.top_k's: ties (many, from small integers) to the lower
    index, a row of -inf, 2-D and 3-D inputs, k up to the whole row."""
    rng = np.random.default_rng(k)
    x = rng.integers(-4, 5, size=(9, 3, 40)).astype(np.float32)
    x[0, 0] = -np.inf
    x[1, 2, 5] = np.inf
    for arr in (jnp.asarray(x), jnp.asarray(x[:, 1])):
        got = jax.jit(lambda a: cpu_ffi.top_k(a, k))(arr)
        want = jax.lax.top_k(arr, k)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)


def test_top_k_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32"):
        cpu_ffi.top_k(jnp.zeros((2, 8), jnp.bfloat16), 2)


# ---- logits_stats (the samplers' argmax and log-sum-exp) ----------------------------------------


@pytest.mark.parametrize("case", range(4))
def test_logits_stats_is_argmax_and_logsumexp(case: int) -> None:
    x = logits_stats_cases()[case]
    argmax, lse = jax.jit(cpu_ffi.logits_stats)(jnp.asarray(x))
    want_argmax, want_lse = logits_stats_reference(x)
    assert argmax.dtype == jnp.int32 and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(argmax), want_argmax)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-6, atol=2e-6)
