"""The FP8 KV cache (kv_cache_dtype="fp8") in the kernels: float8 e4m3 conversion exact both
ways (all 256 codes read, floats rounded to nearest even and saturated as ml_dtypes and torch
round), and each kernel with fp8 caches against its reference, which dequantizes (cache * scale):
the torch C++ CPU ops (write_kv, attention, the fused decoder layer) and the jnp references."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch

from pagedjax.kernels_cuda import ops, reference
from tests.kernels.naive import make_ragged_case, naive_ragged_paged_attention

FP8 = ml_dtypes.float8_e4m3fn
ALL_CODES = np.arange(256, dtype=np.uint8)


@pytest.fixture(scope="module", autouse=True)
def compiled_ops() -> None:
    assert ops.ops_backend() in ("cpp", "cuda"), "the C++ ops must build on the test machines"


def fp8_round(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """x / scale as an fp8 cache stores it, by ml_dtypes: nearest even, saturated to +-448."""
    return np.clip(x.astype(np.float32) / np.float32(scale), -448, 448).astype(FP8)


def hard_floats(rng: np.random.Generator) -> np.ndarray:
    """Every e4m3 value, every midpoint between neighbours (ties to even), their neighbours
    one float32 ulp away, subnormals, zeros, overflow, infinities, NaN and random floats."""
    values = np.sort(ALL_CODES.view(FP8).astype(np.float32)[~np.isnan(
        ALL_CODES.view(FP8).astype(np.float32))])
    midpoints = (values[1:] + values[:-1]) / 2
    special = np.array([0.0, -0.0, 1e-12, -3e-3, 2.0**-10, 2.0**-9 * 1.5, 448.0, 449.0, 463.9,
                        464.0, 480.0, -1e6, np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([
        values, midpoints, np.nextafter(midpoints, np.inf), np.nextafter(midpoints, -np.inf),
        special, rng.standard_normal(4000).astype(np.float32) * 50,
        rng.standard_normal(1000).astype(np.float32) * 0.01]).astype(np.float32)


def test_ml_dtypes_and_torch_round_alike() -> None:
    """The two references the kernels are held to agree, NaN and saturation included."""
    x = hard_floats(np.random.default_rng(0))
    ours = fp8_round(x).view(np.uint8)
    theirs = reference.to_fp8(torch.from_numpy(x), 1.0).view(torch.uint8).numpy()
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.all(ours[nan] & 0x7F == 0x7F) and np.all(theirs[nan] & 0x7F == 0x7F)


def _write(x: np.ndarray, scale: float) -> np.ndarray:
    """x [n] through the C++ write_kv into an fp8 cache (one head row of D = n per token)."""
    rows = torch.from_numpy(x.reshape(-1, 1, 16))  # [T, 1, 16]
    k_cache = torch.zeros((rows.shape[0], 1, 1, 16), dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(rows.shape[0], dtype=torch.int32)
    torch.ops.pagedjax.write_kv(rows, -rows, k_cache, v_cache, slots, scale, scale)
    return k_cache.view(torch.uint8).numpy().reshape(-1), v_cache.view(torch.uint8).numpy()


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_write_kv_rounds_to_nearest_even_and_saturates(scale: float) -> None:
    x = hard_floats(np.random.default_rng(1))
    x = x[: len(x) // 16 * 16]
    k_codes, v_codes = _write(x, scale)
    want = fp8_round(x, scale).view(np.uint8)
    nan = np.isnan(x)
    np.testing.assert_array_equal(k_codes[~nan], want[~nan])
    np.testing.assert_array_equal(v_codes.reshape(-1)[~nan], fp8_round(-x, scale).view(
        np.uint8)[~nan])
    assert np.all(k_codes[nan] & 0x7F == 0x7F)


def test_attention_reads_every_code_exactly() -> None:
    """One key: the output is its value row exactly (softmax weight 1), so a value row holding
    all 256 codes reads back each code's value times v_scale."""
    v_scale = 0.75
    q = torch.zeros((1, 1, 256))
    k_cache = torch.zeros((1, 1, 8, 256), dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros((1, 1, 8, 256), dtype=torch.uint8)
    v_cache[0, 0, 0] = torch.from_numpy(ALL_CODES)
    v_cache = v_cache.view(torch.float8_e4m3fn)
    one = torch.ones(1, dtype=torch.int32)
    out = torch.ops.pagedjax.ragged_paged_attention(
        q, k_cache, v_cache, one, torch.zeros((1, 1), dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), 1.0, None, None, None, 2.0, v_scale)
    want = ALL_CODES.view(FP8).astype(np.float32) * np.float32(v_scale)
    np.testing.assert_array_equal(out.numpy().reshape(-1), want)  # NaN codes read NaN


def _fp8_case(seed: int, head_dim: int = 32, block_size: int = 16,
              dtype: torch.dtype = torch.float32, decode: bool = False) -> tuple[dict, dict]:
    """A ragged batch (decode, prefill over a prefix, a padding row; decode: one token a
    sequence) with fp8 caches: (torch arguments, float64 dequantized caches for the oracle)."""
    rng = np.random.default_rng(seed)
    q_lens, padding = ([1, 1, 1, 1], 0) if decode else ([1, 5, 1, 17], 1)
    case = make_ragged_case(rng, q_lens, [9, 21, 40, 17], num_q_heads=8, num_kv_heads=2,
                            head_dim=head_dim, block_size=block_size, num_padding_rows=padding)
    k_scale, v_scale = 0.05, 0.02
    args = {name: torch.from_numpy(np.ascontiguousarray(case[name])) for name in
            ("kv_lens", "block_tables", "query_start_loc")}
    args["q"] = torch.from_numpy(case["q"]).to(dtype)
    dequantized = {}
    for name, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        codes = fp8_round(case[name], scale)
        args[name] = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn)
        dequantized[name] = codes.astype(np.float64) * scale
    return args, dict(dequantized, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_over_fp8_caches_matches_the_dequantized_oracle(dtype, bound) -> None:
    args, deq = _fp8_case(3, dtype=dtype)
    names = ("q", "k_cache", "v_cache", "kv_lens", "block_tables", "query_start_loc")
    got = ops.ragged_paged_attention(*(args[n] for n in names), sm_scale=0.2,
                                     k_scale=deq["k_scale"], v_scale=deq["v_scale"])
    want = naive_ragged_paged_attention(
        args["q"].double().numpy(), deq["k_cache"], deq["v_cache"], args["kv_lens"].numpy(),
        args["block_tables"].numpy(), args["query_start_loc"].numpy(), sm_scale=0.2)
    real = int(args["query_start_loc"][-1])
    np.testing.assert_allclose(got.double().numpy()[:real], want[:real], rtol=0,
                               atol=bound * np.abs(want).max())
    assert np.all(got.double().numpy()[real:] == 0)
    torch_ref = reference.ragged_paged_attention(*(args[n] for n in names), sm_scale=0.2,
                                                 k_scale=deq["k_scale"], v_scale=deq["v_scale"])
    np.testing.assert_allclose(torch_ref.double().numpy(), got.double().numpy(), rtol=0,
                               atol=bound * np.abs(want).max())


def test_write_kv_op_and_reference_store_the_same_bytes() -> None:
    rng = np.random.default_rng(4)
    k = torch.from_numpy(rng.standard_normal((6, 2, 32)).astype(np.float32) * 30)
    v = torch.from_numpy(rng.standard_normal((6, 2, 32)).astype(np.float32))
    slots = torch.tensor([3, -1, 17, 0, 31, -1], dtype=torch.int32)
    caches = [torch.zeros((2, 2, 16, 32), dtype=torch.float8_e4m3fn) for _ in range(4)]
    torch.ops.pagedjax.write_kv(k, v, caches[0], caches[1], slots, 0.1, 0.01)
    reference.write_kv(k, v, caches[2], caches[3], slots, 0.1, 0.01)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].view(torch.uint8).count_nonzero() > 0


@pytest.mark.parametrize("args,message", [
    (dict(k_scale=0.0), "k_scale and v_scale must be finite and > 0"),
    (dict(v_cache_dtype=torch.float32), "v_cache has dtype Float but expected Float8_e4m3fn"),
])
def test_bad_fp8_arguments_are_named(args: dict, message: str) -> None:
    case, deq = _fp8_case(5)
    v_cache = case["v_cache"]
    if "v_cache_dtype" in args:
        v_cache = torch.zeros(v_cache.shape, dtype=args["v_cache_dtype"])
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedjax.ragged_paged_attention(
            case["q"], case["k_cache"], v_cache, case["kv_lens"], case["block_tables"],
            case["query_start_loc"], 0.2, None, None, None, args.get("k_scale", 1.0), 1.0)


def _jax_args(args: dict) -> tuple:
    """The torch case as jnp arrays (fp8 caches as jnp.float8_e4m3fn)."""
    import jax.numpy as jnp

    def array(t: torch.Tensor):
        if t.dtype == torch.float8_e4m3fn:
            return jnp.asarray(t.view(torch.uint8).numpy().view(FP8))
        return jnp.asarray(t.float().numpy() if t.is_floating_point() else t.numpy())

    names = ("q", "k_cache", "v_cache", "kv_lens", "block_tables", "query_start_loc")
    return tuple(array(args[n]) for n in names)


@pytest.mark.parametrize("impl", ["reference", "tiled", "cpu_ffi", "pallas", "pallas_decode"])
def test_jax_attention_over_fp8_caches_matches_the_dequantized_oracle(impl: str) -> None:
    """Every jax attention, the Pallas kernel interpreted (pages converted in the kernel)."""
    from pagedjax.backends.jax import cpu_ffi
    from pagedjax.kernels_pallas import ragged_paged_attention
    from pagedjax.kernels_pallas.reference import ragged_paged_attention_reference
    from pagedjax.kernels_pallas.tiled_attention import ragged_paged_attention_tiled

    pallas = functools.partial(ragged_paged_attention, interpret=True)
    fn = {"reference": ragged_paged_attention_reference, "tiled": ragged_paged_attention_tiled,
          "cpu_ffi": cpu_ffi.ragged_paged_attention, "pallas": pallas,
          "pallas_decode": functools.partial(pallas, decode=True)}[impl]
    if impl == "cpu_ffi":
        assert cpu_ffi.available()
    args, deq = _fp8_case(6, decode=impl == "pallas_decode")
    jargs = _jax_args(args)
    assert jargs[1].dtype == "float8_e4m3fn"
    got = np.asarray(fn(*jargs, sm_scale=0.2, k_scale=deq["k_scale"], v_scale=deq["v_scale"]),
                     np.float64)
    want = naive_ragged_paged_attention(
        np.asarray(jargs[0], np.float64), deq["k_cache"], deq["v_cache"], *map(np.asarray,
                                                                               jargs[3:]),
        sm_scale=0.2)
    real = int(args["query_start_loc"][-1])
    np.testing.assert_allclose(got[:real], want[:real], rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.all(got[real:] == 0)


def test_jax_write_kv_stores_the_bytes_of_the_torch_op() -> None:
    import jax.numpy as jnp

    from pagedjax.kernels_pallas import write_kv

    rng = np.random.default_rng(8)
    k = rng.standard_normal((6, 2, 32)).astype(np.float32) * 30
    v = rng.standard_normal((6, 2, 32)).astype(np.float32)
    slots = np.array([3, -1, 17, 0, 31, -1], np.int32)
    zeros = jnp.zeros((2, 2, 16, 32), jnp.float8_e4m3fn)
    k_cache, v_cache = write_kv(jnp.asarray(k), jnp.asarray(v), zeros, jnp.zeros_like(zeros),
                                jnp.asarray(slots), k_scale=0.1, v_scale=0.01)
    want = [torch.zeros((2, 2, 16, 32), dtype=torch.float8_e4m3fn) for _ in range(2)]
    torch.ops.pagedjax.write_kv(torch.from_numpy(k), torch.from_numpy(v), *want,
                                torch.from_numpy(slots), 0.1, 0.01)
    for got, expected in zip((k_cache, v_cache), want):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      expected.view(torch.uint8).numpy())


@pytest.mark.parametrize("first", [False, True])
def test_fused_decoder_layer_over_fp8_caches(first: bool) -> None:
    """The fused layer (torch op and FFI handler, bit for bit alike) with fp8 caches: it writes
    the fp8 bytes of the keys and values the float32 layer writes, and reads its caches as the
    float32 layer reads their dequantized values."""
    import jax
    import jax.numpy as jnp

    from pagedjax.backends.jax import cpu_ffi
    from tests.kernels.test_cpu_decoder_layer import EPS, _case

    assert cpu_ffi.available()  # registers the FFI handlers (whatever test ran before)
    c = _case(np.random.default_rng(9), hidden=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
              intermediate=96, bias=True)
    k_scale, v_scale = 0.05, 0.03
    codes = {"k_cache": fp8_round(c["k_cache"], k_scale), "v_cache": fp8_round(c["v_cache"],
                                                                               v_scale)}
    t = {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in c.items()}
    packed = {n: ops.pack_linear_weight(t[n]) for n in ("qkv", "o", "gate_up", "down")}

    def torch_layer(k_cache, v_cache, scales, slot_mapping):
        out, stream = torch.ops.pagedjax.decoder_layer(
            t["x"], None if first else t["residual"], t["input_norm"], packed["qkv"],
            t["qkv_bias"], packed["o"], t["post_norm"], packed["gate_up"], packed["down"],
            k_cache, v_cache, t["cos"], t["sin"], slot_mapping, t["kv_lens"],
            t["block_tables"], t["query_start_loc"], 4, 2, 96, EPS, 16**-0.5, None, None, None,
            *scales)
        return out.numpy(), stream.numpy()

    fp8 = {n: torch.from_numpy(codes[n].view(np.uint8).copy()).view(torch.float8_e4m3fn)
           for n in codes}
    out, stream = torch_layer(fp8["k_cache"], fp8["v_cache"], (k_scale, v_scale),
                              t["slot_mapping"])
    # the float32 layer over the dequantized caches writes the keys and values that fp8 stores
    floats = {n: torch.from_numpy(codes[n].astype(np.float32) * np.float32(s))
              for n, s in (("k_cache", k_scale), ("v_cache", v_scale))}
    torch_layer(floats["k_cache"], floats["v_cache"], (1.0, 1.0), t["slot_mapping"])
    for name, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        stored = fp8_round(floats[name].numpy(), scale)
        np.testing.assert_array_equal(fp8[name].view(torch.uint8).numpy(), stored.view(np.uint8))
        floats[name] = torch.from_numpy(stored.astype(np.float32) * np.float32(scale))
    # and, writing nothing, over the caches fp8 holds now it computes the fp8 layer's bits
    no_slots = torch.full_like(t["slot_mapping"], -1)
    float_out, float_stream = torch_layer(floats["k_cache"], floats["v_cache"], (1.0, 1.0),
                                          no_slots)
    real = int(c["query_start_loc"][-1])
    np.testing.assert_array_equal(out[:real], float_out[:real])
    np.testing.assert_array_equal(stream[:real], float_stream[:real])

    pack = {n: cpu_ffi.pack_linear_weight(jnp.asarray(c[n])) for n in packed}
    weights = cpu_ffi.DecoderLayerWeights(
        jnp.asarray(c["input_norm"]), pack["qkv"], jnp.asarray(c["qkv_bias"]), pack["o"],
        jnp.asarray(c["post_norm"]), pack["gate_up"], pack["down"])

    def jax_layer(x, residual, k_cache, v_cache):
        return cpu_ffi.decoder_layer(
            x, None if first else residual, weights, (k_cache, v_cache), *(
                jnp.asarray(c[n]) for n in ("cos", "sin", "slot_mapping", "kv_lens",
                                            "block_tables", "query_start_loc")),
            num_q_heads=4, intermediate_size=96, eps=EPS, sm_scale=16**-0.5,
            k_scale=k_scale, v_scale=v_scale)

    j_out, j_stream, (j_k, j_v) = jax.jit(jax_layer, donate_argnums=(2, 3))(
        jnp.asarray(c["x"]), jnp.asarray(c["residual"]), jnp.asarray(codes["k_cache"]),
        jnp.asarray(codes["v_cache"]))
    np.testing.assert_array_equal(np.asarray(j_out)[:real], out[:real])
    np.testing.assert_array_equal(np.asarray(j_stream)[:real], stream[:real])
    np.testing.assert_array_equal(np.asarray(j_k).view(np.uint8),
                                  fp8["k_cache"].view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(j_v).view(np.uint8),
                                  fp8["v_cache"].view(torch.uint8).numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_cuda_ops_over_fp8_caches(torch_cuda, dtype, bound, head_dim) -> None:
    """The CUDA write_kv stores the C++ op's bytes; the CUDA attention reads fp8 caches as the
    dequantized oracle says (decode and multi-token paths)."""
    rng = np.random.default_rng(10)
    k = torch.from_numpy(rng.standard_normal((6, 2, head_dim)).astype(np.float32) * 30)
    v = torch.from_numpy(rng.standard_normal((6, 2, head_dim)).astype(np.float32))
    slots = torch.tensor([3, -1, 17, 0, 31, -1], dtype=torch.int32)
    caches = [torch.zeros((2, 2, 16, head_dim), dtype=torch.float8_e4m3fn) for _ in range(2)]
    torch.ops.pagedjax.write_kv(k, v, *caches, slots, 0.1, 0.01)
    on_gpu = [torch.zeros_like(c, device=torch_cuda) for c in caches]
    torch.ops.pagedjax.write_kv(k.to(torch_cuda, dtype), v.to(torch_cuda, dtype), *on_gpu,
                                slots.to(torch_cuda), 0.1, 0.01)
    if dtype == torch.float32:
        for got, want in zip(on_gpu, caches):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    for decode in (True, False):
        args, deq = _fp8_case(11, head_dim=head_dim, dtype=dtype, decode=decode)
        names = ("q", "k_cache", "v_cache", "kv_lens", "block_tables", "query_start_loc")
        got = ops.ragged_paged_attention(*(args[n].to(torch_cuda) for n in names), sm_scale=0.2,
                                         k_scale=deq["k_scale"], v_scale=deq["v_scale"],
                                         max_query_len=1 if decode else None).double().cpu()
        want = naive_ragged_paged_attention(
            args["q"].double().numpy(), deq["k_cache"], deq["v_cache"], args["kv_lens"].numpy(),
            args["block_tables"].numpy(), args["query_start_loc"].numpy(), sm_scale=0.2)
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=bound * np.abs(want).max())
