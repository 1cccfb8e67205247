"""The C++ CPU ops of the decode step besides attention: `pagedjax::linear` over packed weights
(against a float64 NumPy matmul), `pagedjax::rotary_embedding_` (against HF's rotate_half), the
norms and activation, and the samplers' passes over the logits (argmax and log-sum-exp, the
grammar's token mask, the Gumbel-max draw)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedjax.kernels_cuda import ops, reference


@pytest.fixture(scope="module", autouse=True)
def compiled_ops() -> None:
    """The op under test is the C++ one, not the reference fallback."""
    assert ops.ops_backend() in ("cpp", "cuda")


def _case(num_rows: int, in_features: int, out_features: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, in_features)).astype(np.float32)
    w = rng.standard_normal((in_features, out_features)).astype(np.float32)
    b = rng.standard_normal(out_features).astype(np.float32)
    return x, w, b


# Row counts cover every row grouping (AVX-512: 4-row blocks, then one block of the last 1-7 rows,
# 7 as 4 + 3; AVX2: 6-row blocks, then 5, 4, 2 and/or 1); column counts cover whole and partial
# 4-tile groups and a last tile that is padded, and threads' tile ranges that do not line up with
# the groups (60 tiles: 30 + 30) while the next tiles are prefetched (10 rows and more).
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 33])
@pytest.mark.parametrize(("in_features", "out_features"),
                         [(64, 16), (48, 40), (256, 384), (96, 100), (8, 1000), (576, 960)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64_matmul(num_rows, in_features, out_features, with_bias):
    x, w, b = _case(num_rows, in_features, out_features)
    bias = torch.from_numpy(b) if with_bias else None
    got = ops.linear(torch.from_numpy(x), ops.pack_linear_weight(torch.from_numpy(w)), bias,
                     out_features)
    want = x.astype(np.float64) @ w.astype(np.float64) + (b if with_bias else 0.0)
    assert got.shape == (num_rows, out_features) and got.is_contiguous()
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64) + 1.0
    assert np.max(np.abs(got.numpy() - want) / scale) < 1e-6


def test_reference_unpacks_the_same_weight():
    x, w, b = _case(5, 48, 40)
    packed = ops.pack_linear_weight(torch.from_numpy(w))
    assert packed.shape == (3, 48, 16)
    assert torch.equal(packed[2, :, 8:], torch.zeros(48, 8))  # the padding columns
    got = reference.linear(torch.from_numpy(x), packed, torch.from_numpy(b), 40)
    torch.testing.assert_close(got, torch.from_numpy(x @ w + b), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    """Every output element is one FMA chain in k order: bit-identical alone or in a batch."""
    x, w, _ = _case(11, 256, 200, seed=1)
    packed = ops.pack_linear_weight(torch.from_numpy(w))
    batch = ops.linear(torch.from_numpy(x), packed, None, 200)
    for row in range(11):
        alone = ops.linear(torch.from_numpy(x[row : row + 1]), packed, None, 200)
        assert torch.equal(alone[0], batch[row])


def test_the_avx2_path_gives_the_same_bits(tmp_path):
    """Where the CPU has AVX-512 the op takes 4 x 64 blocks; PAGEDJAX_NO_AVX512=1 (a fresh
    process) takes AVX2's 4 x 16: each element is the same FMA chain in k order either way."""
    x, w, b = _case(7, 96, 72, seed=2)
    packed = ops.pack_linear_weight(torch.from_numpy(w))
    torch.save((torch.from_numpy(x), packed, torch.from_numpy(b)), tmp_path / "case.pt")
    script = ("import sys, torch\n"
              "from pagedjax.kernels_cuda import ops\n"
              "x, packed, b = torch.load(sys.argv[1])\n"
              "torch.save(ops.linear(x, packed, b, 72), sys.argv[2])\n")
    env = {**os.environ, "PAGEDJAX_NO_AVX512": "1"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"),
                    str(tmp_path / "avx2.pt")], env=env, check=True)
    avx2 = torch.load(tmp_path / "avx2.pt")
    assert torch.equal(ops.linear(torch.from_numpy(x), packed, torch.from_numpy(b), 72), avx2)


def test_strided_rows_and_empty_input():
    x, w, _ = _case(6, 64, 48)
    wide = torch.zeros(6, 80)
    wide[:, 8:72] = torch.from_numpy(x)
    packed = ops.pack_linear_weight(torch.from_numpy(w))
    got = ops.linear(wide[:, 8:72], packed, None, 48)  # rows 80 floats apart
    torch.testing.assert_close(got, torch.from_numpy(x @ w), rtol=1e-5, atol=1e-5)
    assert ops.linear(torch.zeros(0, 64), packed, None, 48).shape == (0, 48)


def test_meta_tensors_trace_shapes():
    packed = torch.empty(3, 64, 16, device="meta")
    out = torch.ops.pagedjax.linear(torch.empty(5, 64, device="meta"), packed, None, 40)
    assert (out.device.type, out.shape) == ("meta", (5, 40))


@pytest.mark.parametrize(
    ("args", "message"),
    [(lambda x, p: (x.double(), p, None, 40), "float32 only"),
     (lambda x, p: (x[:, :32], p, None, 40), "in_features=32"),
     (lambda x, p: (x, p, None, 16), "out_features=16 does not match 3 tiles"),
     (lambda x, p: (x, p, torch.zeros(39), 40), "bias must be a contiguous float32 \\[40\\]"),
     (lambda x, p: (x.t(), p, None, 40), "rows must be contiguous")],
)  # fmt: skip
def test_linear_rejects_bad_arguments(args, message):
    x, w, _ = _case(64, 64, 40)
    packed = ops.pack_linear_weight(torch.from_numpy(w))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedjax.linear(*args(torch.from_numpy(x), packed))


def _hf_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF's apply_rotary_pos_emb in float64: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _rope_case(num_tokens: int, head_dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 500, num_tokens)
    freqs = positions[:, None] * (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim))[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return (torch.from_numpy(np.cos(emb).astype(np.float32)),
            torch.from_numpy(np.sin(emb).astype(np.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["op", "reference"])
def test_rotary_rotates_the_q_and_k_heads_of_a_fused_projection_in_place(dtype, impl):
    """x is the q and k heads of a qkv row (strided view); the v heads stay untouched."""
    num_tokens, q_heads, kv_heads, d = 7, 4, 2, 64
    cos, sin = _rope_case(num_tokens, d)
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * d).to(dtype)
    before = qkv.clone()
    qk = qkv[:, : (q_heads + kv_heads) * d].view(num_tokens, q_heads + kv_heads, d)
    if impl == "op":
        torch.ops.pagedjax.rotary_embedding_(qk, cos, sin)
    else:
        reference.rotary_embedding_(qk, cos, sin)
    x = before[:, : (q_heads + kv_heads) * d].double().view(num_tokens, -1, d).numpy()
    want = _hf_rope(x, cos.double().numpy(), sin.double().numpy())
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(qk.double().numpy(), want, atol=tolerance * 4, rtol=tolerance)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * d :], before[:, (q_heads + kv_heads) * d :])


def test_rotary_wrapper_uses_the_reference_off_the_cpu_path(monkeypatch):
    monkeypatch.setattr(ops, "ops_backend", lambda: "reference")
    cos, sin = _rope_case(3, 16)
    x = torch.randn(3, 2, 16)
    want = x.clone()
    reference.rotary_embedding_(want, cos, sin)
    ops.rotary_embedding_(x, cos, sin)
    assert torch.equal(x, want)


@pytest.mark.parametrize(
    ("x", "cos_shape", "message"),
    [(torch.zeros(3, 2, 15), (3, 15), "even head_dim"),
     (torch.zeros(3, 16, 2).transpose(1, 2), (3, 16), "heads must be contiguous"),
     (torch.zeros(3, 2, 16), (4, 16), "cos and sin must be contiguous float32 \\[3, 16\\]")],
)  # fmt: skip
def test_rotary_rejects_bad_arguments(x, cos_shape, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedjax.rotary_embedding_(x, torch.zeros(cos_shape), torch.zeros(cos_shape))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_and_its_fused_residual_add_match_hf(dtype, tolerance):
    """HF's rounding: the same result as the reference to the dtype's last bit or so."""
    x, residual = (torch.randn(5, 96).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    got = torch.ops.pagedjax.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-5), rtol=tolerance,
                               atol=tolerance)
    normed, summed = torch.ops.pagedjax.fused_add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)  # one rounded add: bit for bit
    torch.testing.assert_close(normed, want_normed, rtol=tolerance, atol=tolerance)


def test_silu_and_mul_matches_float64_within_a_few_ulp():
    """float32: one vectorised pass (the polynomial exp), rows across threads, tails of n % 8."""
    x = 6 * torch.randn(300, 2 * 45)
    x[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])  # the exp's clamped ends
    got = torch.ops.pagedjax.silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert got.shape == (300, 45)
    torch.testing.assert_close(got.double(), want, rtol=4e-7, atol=1e-30)


def test_silu_and_mul_equals_the_reference_in_bf16():
    x = (3 * torch.randn(6, 2 * 40)).to(torch.bfloat16)
    got = torch.ops.pagedjax.silu_and_mul(x)
    assert got.shape == (6, 40) and torch.equal(got, reference.silu_and_mul(x))


def test_rms_norm_of_a_row_does_not_depend_on_the_batch():
    """The sum of squares runs in a fixed order: a row alone equals the same row in a batch (rows
    split across threads), bit for bit, and it stays within rounding of float64."""
    x, residual = torch.randn(257, 100), torch.randn(257, 100)
    weight = 1 + 0.1 * torch.randn(100)
    batch = torch.ops.pagedjax.rms_norm(x, weight, 1e-5)
    fused, _ = torch.ops.pagedjax.fused_add_rms_norm(x, residual, weight, 1e-5)
    for row in (0, 100, 256):
        assert torch.equal(torch.ops.pagedjax.rms_norm(x[row : row + 1], weight, 1e-5),
                           batch[row : row + 1])
        alone, _ = torch.ops.pagedjax.fused_add_rms_norm(
            x[row : row + 1], residual[row : row + 1], weight, 1e-5)
        assert torch.equal(alone, fused[row : row + 1])
    x64 = x.double()
    want = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(batch.double(), want, rtol=2e-6, atol=1e-6)


def test_norm_and_activation_wrappers_use_the_reference_without_the_ops(monkeypatch):
    monkeypatch.setattr(ops, "ops_backend", lambda: "reference")
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    for got, want in zip(ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                         reference.fused_add_rms_norm(x, residual, weight, 1e-6), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda: torch.ops.pagedjax.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6),
      "weight must be a contiguous Float \\[8\\]"),
     (lambda: torch.ops.pagedjax.fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8),
                                                    torch.zeros(8), 1e-6), "residual must match x"),
     (lambda: torch.ops.pagedjax.silu_and_mul(torch.zeros(2, 7)), "2 \\* intermediate")],
)  # fmt: skip
def test_norm_and_activation_reject_bad_arguments(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("case", range(4))
def test_logits_stats_is_argmax_and_logsumexp(case: int) -> None:
    """The torch op of the samplers' one pass (the JAX FFI's kernel: test_cpu_ffi.py)."""
    from tests.kernels.naive import logits_stats_cases, logits_stats_reference

    x = logits_stats_cases()[case]
    argmax, lse = torch.ops.pagedjax.logits_stats(torch.from_numpy(x))
    want_argmax, want_lse = logits_stats_reference(x)
    assert argmax.dtype == torch.int32 and lse.dtype == torch.float32
    np.testing.assert_array_equal(argmax.numpy(), want_argmax)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=2e-6, atol=2e-6)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.pagedjax.logits_stats(torch.from_numpy(x).double())


@pytest.mark.parametrize("case", range(4))
def test_apply_token_bitmask_masks_and_finds_the_argmax_in_one_pass(case: int) -> None:
    """The torch op of the grammar's token mask against NumPy: the same bits, the same argmax."""
    from tests.kernels.naive import token_mask_cases, token_mask_reference

    x, bitmask = token_mask_cases()[case]
    out, argmax = torch.ops.pagedjax.apply_token_bitmask(torch.from_numpy(x),
                                                         torch.from_numpy(bitmask))
    want_out, want_argmax = token_mask_reference(x, bitmask)
    assert out.dtype == torch.float32 and argmax.dtype == torch.int32
    np.testing.assert_array_equal(out.numpy(), want_out)
    np.testing.assert_array_equal(argmax.numpy(), want_argmax)


@pytest.mark.parametrize(("logits", "bitmask", "message"), [
    (torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32),
     "contiguous float32"),
    (torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int32), r"int32 \[2, >= 2\]"),
    (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), r"int32 \[2, >= 2\]"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), r"int32 \[2, >= 2\]"),
])
def test_apply_token_bitmask_rejects_bad_arguments(logits, bitmask, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedjax.apply_token_bitmask(logits, bitmask)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (40, 1003), (3, 13), (2, 5)])
def test_gumbel_argmax_draws_the_rngs_categorical_sample(rows: int, vocab: int) -> None:
    """The samplers' Gumbel-max draw: argmax(x - log(-log(u))) with pagedjax.rng's uniforms,
    against float64 math on the NumPy reference's uniforms (filtered -inf entries, a vocabulary
    not a multiple of 8, seeds and steps over the whole uint32 range): the same tokens but where
    the two best candidates lie within float32 rounding; and against the torch ops it replaces."""
    from pagedjax import rng as prng
    from pagedjax.backends.torch.sampler import gumbel_argmax, uniform

    gen = np.random.default_rng(rows)
    x = (gen.standard_normal((rows, vocab)) * 4).astype(np.float32)
    x[:, 1::5] = -np.inf
    seeds = gen.integers(0, 2**32, rows, dtype=np.int64)
    steps = gen.integers(0, 2**32, rows, dtype=np.int64)
    got = torch.ops.pagedjax.gumbel_argmax(torch.from_numpy(x), torch.from_numpy(seeds),
                                           torch.from_numpy(steps)).numpy()
    u = prng.uniform(seeds.astype(np.uint32), steps.astype(np.uint32), vocab).astype(np.float64)
    values = x.astype(np.float64) - np.log(-np.log(u))  # [rows, vocab]
    want = values.argmax(-1)
    assert got.dtype == np.int32
    rows_at = np.arange(rows)
    assert np.all((got == want) | (values[rows_at, want] - values[rows_at, got] < 1e-5))
    assert np.isfinite(x[rows_at, got]).all()
    x_t, seeds_t, steps_t = (torch.from_numpy(a) for a in (x, seeds, steps))
    ops_way = torch.argmax(x_t - torch.log(-torch.log(uniform(seeds_t, steps_t, vocab))), dim=-1)
    assert np.mean(got == ops_way.numpy()) >= 0.95
    np.testing.assert_array_equal(gumbel_argmax(x_t, seeds_t, steps_t).numpy(), got)


def test_gumbel_argmax_takes_a_rows_first_nan_and_rejects_bad_arguments() -> None:
    x = torch.zeros(2, 30)
    x[1, 17], x[1, 25] = float("nan"), float("nan")
    tokens = torch.ops.pagedjax.gumbel_argmax(x, torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert tokens[1] == 17
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.pagedjax.gumbel_argmax(x.double(), torch.tensor([1, 2]), torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match=r"seeds and steps must be \[2\]"):
        torch.ops.pagedjax.gumbel_argmax(x, torch.tensor([1]), torch.tensor([3, 4]))


@pytest.mark.parametrize("vocab", [4099, 49152])
def test_filter_logits_keeps_what_the_sorted_definition_keeps(vocab: int) -> None:
    """The C++ top-k / top-p / min-p filter against the samplers' sort-based definition, over
    knob mixes that take each of its paths: a top_k under V / 8 (a one-pass heap), a larger one
    (nth_element), none; top_p from 0 (padding rows) to 1, over rows whose mass lies near their
    largest logit (read alone) or not; min_p; ties among the logits."""
    from pagedjax.backends.torch.sampler import filter_logits, filter_logits_sorted

    knobs = [(1, 1.0, 0.0), (5, 0.9, 0.0), (50, 0.9, 0.0), (50, 1.0, 0.05), (600, 0.95, 0.0),
             (vocab // 4, 0.8, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.1), (0, 1.0, 0.5), (0, 0.0, 0.0),
             (vocab + 7, 0.99, 0.0), (20, 0.0, 0.0)]
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(knobs), vocab, generator=gen) * 2.5
    logits[[6, 7, 10]] *= 4  # spread rows: top-p reads only the logits near the largest
    logits[1::2] = torch.round(logits[1::2] * 4) / 4  # many ties
    top_k = torch.tensor([k for k, _, _ in knobs])
    top_p = torch.tensor([p for _, p, _ in knobs])
    min_p = torch.tensor([m for _, _, m in knobs])
    want = filter_logits_sorted(logits, top_k, top_p, min_p)
    got = filter_logits(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(want)])
