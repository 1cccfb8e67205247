"""The pagedjax torch custom ops against the float64 oracle and the references.

Tensors live on `cuda` when a GPU is visible (so the CUDA kernels are what is tested there) and on
the CPU otherwise (the C++ kernels). float64, which has no CUDA kernel, and the data checks only
the C++ kernel makes (they would need a device sync) always run on the CPU. Tests marked `gpu`
need one; they are deselected by default (run `python -m pytest -m "gpu or not gpu"`).

Unwritten output is caught by NaN: every call writes into a NaN-filled `out`, and cache slots no
sequence owns (past each kv_len, and spare blocks) hold NaN, so a kernel that skips a row or reads
past a context shows up. Each test asserts no NaN anywhere and exact zeros on padding rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedjax.kernels_cuda import ops, reference
from tests.kernels.naive import (
    make_ragged_case,
    naive_ragged_paged_attention,
    per_row_relative_error,
    soft_cap_effect,
)

_BOUNDS = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_CPU = torch.device("cpu")
_MAX_LEN = 150
# (head_dim, block_size, GQA group): every head_dim, block size and group appears at least once.
_SHAPES = [(16, 16, 2), (32, 16, 4), (64, 8, 1), (64, 32, 8), (80, 16, 2), (80, 8, 4),
           (128, 32, 2), (128, 16, 8)]


@pytest.fixture(scope="session", autouse=True)
def compiled_ops() -> str:
    """Builds (or loads) the extension once; fails if it silently fell back to the reference."""
    backend = ops.ops_backend()
    assert backend == ("cuda" if torch.cuda.is_available() else "cpp")
    return backend


def _batch(kind: str, bs: int) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens): context lengths 1, bs - 1, bs, bs + 1 and a long one in every kind."""
    return {
        "decode": ([1] * 6, [1, bs - 1, bs, bs + 1, 3 * bs + 5, _MAX_LEN]),
        "prefill_with_prefix": (
            [bs + 1, 5, bs - 1, bs, 1],
            [2 * bs + 3, 5, bs - 1, 3 * bs, bs + 1],
        ),
        "mixed": ([1, 0, 7, bs + 1, 1, 3, 0], [bs + 1, bs, 7, 2 * bs + 1, 1, _MAX_LEN, 1]),
    }[kind]


def _case(kind: str, *, head_dim: int, block_size: int, group: int, seed: int = 0) -> dict:
    """A float32 NumPy case with 3 padding rows and 2 KV heads."""
    q_lens, kv_lens = _batch(kind, block_size)
    return make_ragged_case(
        np.random.default_rng(seed), q_lens, kv_lens, num_q_heads=2 * group, num_kv_heads=2,
        head_dim=head_dim, block_size=block_size, num_padding_rows=3,
    )  # fmt: skip


def _poison_unowned_slots(case: dict) -> None:
    """NaN in every cache slot that is no sequence's context (in place)."""
    block_size = case["k_cache"].shape[2]
    owned = np.zeros(case["k_cache"].shape[0] * block_size, bool)
    for table, kv_len in zip(case["block_tables"], case["kv_lens"]):
        positions = np.arange(kv_len)
        owned[table[positions // block_size] * block_size + positions % block_size] = True
    owned = owned.reshape(-1, 1, block_size, 1)  # broadcast over heads and head_dim
    case["k_cache"][:] = np.where(owned, case["k_cache"], np.nan)
    case["v_cache"][:] = np.where(owned, case["v_cache"], np.nan)


def _torch_args(case: dict, dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """The case as torch tensors on `device` (default: DEVICE, the CPU for float64); q and the
    caches in `dtype`."""
    device = device or (_CPU if dtype == torch.float64 else DEVICE)
    args = {name: torch.from_numpy(value).to(device) for name, value in case.items()}
    for name in ("q", "k_cache", "v_cache"):
        args[name] = args[name].to(dtype)
    return args


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.double().cpu().numpy()


def _host_copy(args: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The op's inputs on the host for the float64 oracle: floats as rounded (float64), the
    integer metadata as integers."""
    return {name: _numpy(value) if value.is_floating_point() else value.cpu().numpy()
            for name, value in args.items()}


def _check(
    kind: str, dtype: torch.dtype, *, head_dim: int, block_size: int, group: int, **options
) -> None:
    case = _case(kind, head_dim=head_dim, block_size=block_size, group=group)
    _poison_unowned_slots(case)
    args = _torch_args(case, dtype)
    out = torch.full_like(args["q"], float("nan"))
    result = ops.ragged_paged_attention(**args, sm_scale=head_dim**-0.5, out=out, **options)
    assert result is out
    # The oracle sees exactly the (rounded) inputs the op saw.
    rounded = _host_copy(args)
    rounded.update({name: case[name] for name in ("kv_lens", "block_tables", "query_start_loc")})
    want = naive_ragged_paged_attention(**rounded, sm_scale=head_dim**-0.5, **options)
    got = _numpy(out)
    assert not np.isnan(got).any(), "unwritten or NaN rows"
    np.testing.assert_array_equal(got[int(case["query_start_loc"][-1]) :], 0.0)
    assert per_row_relative_error(got, want) <= _BOUNDS[dtype]
    torch_reference = reference.ragged_paged_attention(**args, sm_scale=head_dim**-0.5, **options)
    assert per_row_relative_error(_numpy(torch_reference), want) <= _BOUNDS[dtype]


@pytest.mark.parametrize("kind", ["decode", "prefill_with_prefix", "mixed"])
@pytest.mark.parametrize(("head_dim", "block_size", "group"), _SHAPES)
def test_attention_float32(kind, head_dim, block_size, group):
    _check(kind, torch.float32, head_dim=head_dim, block_size=block_size, group=group)


@pytest.mark.parametrize("kind", ["decode", "prefill_with_prefix", "mixed"])
@pytest.mark.parametrize(
    "options",
    [{"sliding_window": 1}, {"sliding_window": 5}, {"sliding_window": 19},
     {"soft_cap": 5.0}, {"sliding_window": 9, "soft_cap": 2.0}],
)  # fmt: skip
def test_attention_window_and_soft_cap(kind, options):
    if "soft_cap" in options:  # the cap changes the answer well beyond the bound
        case = _case(kind, head_dim=80, block_size=16, group=4)
        assert soft_cap_effect(case, sm_scale=80**-0.5, **options) > 0.1
    _check(kind, torch.float32, head_dim=80, block_size=16, group=4, **options)


@pytest.mark.parametrize("kind", ["decode", "prefill_with_prefix", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_attention_dtypes(kind, dtype):
    _check(kind, dtype, head_dim=128, block_size=16, group=4, sliding_window=21)


def test_functional_op_matches_out_variant_on_strided_q():
    """q as a view into a fused qkv projection (strided over tokens), as the model passes it;
    the max_query_len launch hint is accepted (and ignored) on CPU."""
    case = _case("mixed", head_dim=64, block_size=16, group=2)
    args = _torch_args(case, torch.float32)
    num_tokens, num_q_heads, head_dim = args["q"].shape
    qkv = torch.randn(num_tokens, (num_q_heads + 4) * head_dim, device=DEVICE)
    qkv[:, : num_q_heads * head_dim] = args["q"].reshape(num_tokens, -1)
    strided_q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    assert not strided_q.is_contiguous()
    out = torch.full_like(args["q"], float("nan"))
    ops.ragged_paged_attention(**args, sm_scale=0.125, out=out)
    args["q"] = strided_q
    max_query_len = int(np.diff(case["query_start_loc"]).max())
    functional = ops.ragged_paged_attention(**args, sm_scale=0.125, max_query_len=max_query_len)
    assert torch.equal(functional, out)


def test_only_padding_rows():
    case = make_ragged_case(np.random.default_rng(0), [], [], num_q_heads=4, num_kv_heads=2,
                            head_dim=64, block_size=8, num_padding_rows=5)  # fmt: skip
    args = _torch_args(case, torch.float32)
    out = torch.full_like(args["q"], float("nan"))
    ops.ragged_paged_attention(**args, sm_scale=0.125, out=out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_one_decoding_row_gives_the_same_bits_on_any_number_of_threads(num_kv_heads):
    """A lone decoding row's KV heads are split over the CPU's threads (SmolLM2's 3 over 2):
    every thread count, and the same row in a batch, give its bits."""
    case = make_ragged_case(np.random.default_rng(4), [1], [_MAX_LEN],
                            num_q_heads=3 * num_kv_heads, num_kv_heads=num_kv_heads,
                            head_dim=64, block_size=16)  # fmt: skip
    args = _torch_args(case, torch.float32, _CPU)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(ops.ragged_paged_attention(**args, sm_scale=0.125).numpy())
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    want = naive_ragged_paged_attention(**_host_copy(args), sm_scale=0.125)
    assert per_row_relative_error(outs[0].astype(np.float64), want) <= _BOUNDS[torch.float32]
    batch = make_ragged_case(np.random.default_rng(5), [1, 1, 1], [9, _MAX_LEN, 30],
                             num_q_heads=3 * num_kv_heads, num_kv_heads=num_kv_heads,
                             head_dim=64, block_size=16)  # fmt: skip
    block = case["block_tables"][0, : -(-_MAX_LEN // 16)]  # the lone row's blocks and query
    for name in ("k_cache", "v_cache"):
        batch[name][batch["block_tables"][1, : len(block)]] = case[name][block]
    batch["q"][1] = case["q"][0]
    in_batch = ops.ragged_paged_attention(**_torch_args(batch, torch.float32, _CPU),
                                          sm_scale=0.125).numpy()
    np.testing.assert_array_equal(in_batch[1], outs[0][0])


@pytest.mark.parametrize("options", [{}, {"sliding_window": 7}, {"soft_cap": 3.0}])
def test_parity_with_jnp_reference(options):
    """The torch op and the jnp reference (the JAX backend's semantics) on the same inputs."""
    jnp = pytest.importorskip("jax.numpy")
    from pagedjax.kernels_pallas.reference import ragged_paged_attention_reference

    case = _case("mixed", head_dim=80, block_size=16, group=4, seed=1)
    got = ops.ragged_paged_attention(**_torch_args(case, torch.float32), sm_scale=0.1, **options)
    jnp_args = {name: jnp.asarray(value) for name, value in case.items()}
    want = np.asarray(ragged_paged_attention_reference(**jnp_args, sm_scale=0.1, **options))
    assert per_row_relative_error(_numpy(got), want) <= 1e-5


def test_meta_tensors_trace_shapes():
    """The Meta kernels let FakeTensor / torch.compile trace the ops without running them."""
    args = {
        name: value.to("meta")
        for name, value in _torch_args(
            _case("decode", head_dim=64, block_size=8, group=2), torch.bfloat16
        ).items()
    }
    out = torch.ops.pagedjax.ragged_paged_attention(*args.values(), 0.125)
    assert (out.device.type, out.shape, out.dtype) == ("meta", args["q"].shape, torch.bfloat16)


@pytest.mark.parametrize(
    ("mutate", "message", "device"),
    [(lambda a: a.update(kv_lens=a["kv_lens"].long()), "kv_lens must be int32", DEVICE),
     (lambda a: a.update(v_cache=a["v_cache"][:, :1].contiguous()), "v_cache has shape", DEVICE),
     # Numbers in the message: a statically linked libstdc++ crashed formatting them (GPU run 1).
     (lambda a: a.update(q=a["q"][:, :3]), "num_q_heads 3 must be a multiple of num_kv_heads 2",
      DEVICE),
     # Data checks: the C++ kernel reads the metadata; the CUDA one cannot without a sync.
     (lambda a: a.update(kv_lens=a["kv_lens"] - 1), "q_len", _CPU),
     (lambda a: a["block_tables"].fill_(10_000), "out of range", _CPU)],
)  # fmt: skip
def test_attention_rejects_bad_arguments(mutate, message, device):
    args = _torch_args(_case("decode", head_dim=64, block_size=8, group=2), torch.float32,
                       device)
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        ops.ragged_paged_attention(**args, sm_scale=0.125)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv(dtype, slot_dtype):
    num_blocks, num_kv_heads, block_size, head_dim, num_tokens = 6, 2, 8, 80, 10
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2))
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views [T, Hkv, D], like a fused projection's output
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[[1, 4, 9]] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = k[t]
            expected_v[slot // block_size, :, slot % block_size] = v[t]
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, reference_k, reference_v, slots.to(slot_dtype))
    ops.write_kv(k, v, k_cache, v_cache, slots.to(slot_dtype))
    for cache, expected, ref in [
        (k_cache, expected_k, reference_k),
        (v_cache, expected_v, reference_v),
    ]:
        assert torch.equal(cache, expected)  # written slots, and every other slot untouched
        assert torch.equal(ref, expected)


def test_write_kv_rejects_bad_arguments():
    k_cache = torch.zeros(2, 1, 4, 8)
    k = torch.ones(3, 1, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\]=8 is out of range"):
        ops.write_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, 8, -1]))  # C++ data check
    k_cache, k = k_cache.to(DEVICE), k.to(DEVICE)
    with pytest.raises(RuntimeError, match="cast it to the cache dtype"):
        ops.write_kv(k.half(), k.half(), k_cache, k_cache.clone(),
                     torch.tensor([0, 1, 2], device=DEVICE))


@pytest.mark.parametrize("failure", ["no_compiler", "build_error"])
def test_failed_build_falls_back_with_one_warning_without_a_gpu(monkeypatch, failure):
    monkeypatch.setattr(ops.torch.cuda, "is_available", lambda: False)
    if failure == "no_compiler":
        monkeypatch.setattr(ops.shutil, "which", lambda name: None)
    else:
        monkeypatch.setattr(ops, "_build", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.warns(RuntimeWarning, match="falling back to the slow pure-torch") as record:
        assert ops.ops_backend.__wrapped__() == "reference"
    assert len(record) == 1


def test_reference_backend_serves_the_wrappers(monkeypatch):
    monkeypatch.setattr(ops, "ops_backend", lambda: "reference")
    case = _case("mixed", head_dim=64, block_size=8, group=2)
    args = _torch_args(case, torch.float32)
    out = torch.full_like(args["q"], float("nan"))
    assert ops.ragged_paged_attention(**args, sm_scale=0.125, out=out) is out
    want = naive_ragged_paged_attention(**case, sm_scale=0.125)
    assert per_row_relative_error(_numpy(out), want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "options"),
                         [(torch.float32, {}), (torch.bfloat16, {}),
                          (torch.float32, {"sliding_window": 3000, "soft_cap": 5.0})])
def test_cuda_kernels_split_long_contexts_on_gpu(torch_cuda, dtype, options):
    """Few sequences with long contexts (the split-K launch), GQA 32/8, on device tensors;
    a window and a soft cap across the splits."""
    assert ops.ops_backend() == "cuda"
    case = make_ragged_case(np.random.default_rng(3), [1, 1, 7], [4000, 130, 2100],
                            num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                            num_padding_rows=2)
    _poison_unowned_slots(case)
    args = _torch_args(case, dtype, torch_cuda)
    out = torch.full_like(args["q"], float("nan"))
    ops.ragged_paged_attention(**args, sm_scale=128**-0.5, max_query_len=7, out=out, **options)
    assert out.is_cuda
    rounded = _host_copy(args)
    want = naive_ragged_paged_attention(**rounded, sm_scale=128**-0.5, **options)
    got = _numpy(out)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[9:], 0.0)
    assert per_row_relative_error(got, want) <= _BOUNDS[dtype]


@pytest.mark.gpu
def test_attention_replays_in_a_cuda_graph(torch_cuda):
    """With max_query_len the op never syncs, so it captures; a replay sees new inputs."""
    case = _case("mixed", head_dim=128, block_size=16, group=4)
    args = _torch_args(case, torch.bfloat16, torch_cuda)
    max_query_len = int(np.diff(case["query_start_loc"]).max())
    out = torch.full_like(args["q"], float("nan"))
    run = lambda: ops.ragged_paged_attention(**args, sm_scale=0.1, max_query_len=max_query_len,
                                             out=out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    args["q"].copy_(torch.randn_like(args["q"]))
    graph.replay()
    torch.cuda.synchronize()
    rounded = _host_copy(args)
    want = naive_ragged_paged_attention(**rounded, sm_scale=0.1)
    assert per_row_relative_error(_numpy(out), want) <= _BOUNDS[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "rtol", "atol"),
                         [(torch.float32, 2e-6, 1e-6), (torch.bfloat16, 1.6e-2, 1e-2)])
def test_norm_rotary_and_activation_kernels_on_gpu(torch_cuda, dtype, rtol, atol):
    """The CUDA rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding_ against the
    eager reference on the same device (float32: to rounding; bf16: within one bf16 step): rows
    of 16-byte vectors held in registers (2048; 9216, four vectors a thread) and the any-size
    kernels (2050, an intermediate of 1001), and a rotary view of a fused qkv."""
    assert ops.ops_backend() == "cuda"
    g = torch.Generator(torch_cuda).manual_seed(0)
    for hidden in (2050, 2048, 9216):
        x, residual = (torch.randn(5, hidden, generator=g, device=torch_cuda, dtype=dtype)
                       for _ in range(2))
        weight = torch.randn(hidden, generator=g, device=torch_cuda, dtype=dtype)
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5),
                                   reference.rms_norm(x, weight, 1e-5), rtol=rtol, atol=atol)
        for got, want in zip(ops.fused_add_rms_norm(x, residual, weight, 1e-5),
                             reference.fused_add_rms_norm(x, residual, weight, 1e-5),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for inter in (1000, 1001, 8192):
        gate_up = torch.randn(5, 2 * inter, generator=g, device=torch_cuda, dtype=dtype)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up),
                                   rtol=rtol, atol=atol)
    qkv = torch.randn(5, 12 * 64, generator=g, device=torch_cuda, dtype=dtype)  # q 8, k 2, v 2
    cos, sin = (torch.rand(5, 64, generator=g, device=torch_cuda) for _ in range(2))
    got, want = qkv.clone(), qkv.clone()
    ops.rotary_embedding_(got[:, : 10 * 64].view(5, 10, 64), cos, sin)
    reference.rotary_embedding_(want[:, : 10 * 64].view(5, 10, 64), cos, sin)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert torch.equal(got[:, 10 * 64 :], qkv[:, 10 * 64 :])  # v untouched
    empty = torch.empty(0, 9216, device=torch_cuda, dtype=dtype)
    assert ops.rms_norm(empty, weight, 1e-5).shape == (0, 9216)


def test_norm_and_rotary_ops_by_device(monkeypatch):
    """Which tensors reach the pagedjax ops: CPU ones with any built extension, CUDA ones only
    with its CUDA build (else the eager reference)."""
    cpu = torch.zeros(2)
    for backend, on_cpu in (("cpp", True), ("cuda", True), ("reference", False)):
        monkeypatch.setattr(ops, "ops_backend", lambda backend=backend: backend)
        assert ops._has_op(cpu) is on_cpu
    fake_cuda = type("FakeCuda", (), {"device": torch.device("cuda", 0)})()
    for backend, on_gpu in (("cpp", False), ("cuda", True), ("reference", False)):
        monkeypatch.setattr(ops, "ops_backend", lambda backend=backend: backend)
        assert ops._has_op(fake_cuda) is on_gpu


def _fused_decode_case(rng, kv_lens: list[int], num_q_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, num_padding_rows: int) -> dict:
    """A decode step: one query row per sequence, then padding rows; this step's k and v (views
    of one [T, Hkv, 2, D] array, as the qkv product's are) and each new token's slot (-1 for
    padding)."""
    case = make_ragged_case(rng, [1] * len(kv_lens), kv_lens, num_q_heads=num_q_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                            num_padding_rows=num_padding_rows)
    num_tokens = len(kv_lens) + num_padding_rows
    case["kv"] = rng.standard_normal((num_tokens, num_kv_heads, 2, head_dim)).astype(np.float32)
    tables = case["block_tables"]
    case["slot_mapping"] = np.asarray(
        [tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
         for s, n in enumerate(kv_lens)] + [-1] * num_padding_rows, np.int32)
    return case


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "cache", "options", "heads"), [
    (torch.bfloat16, "model", {}, (32, 8)),
    (torch.float32, "model", {"sliding_window": 300, "soft_cap": 5.0}, (32, 8)),
    (torch.bfloat16, "fp8", {}, (32, 8)),
    (torch.bfloat16, "model", {}, (32, 2)),  # a group of 16: two query tiles store the token
])
def test_fused_decode_equals_write_kv_then_attention(torch_cuda, dtype, cache, options, heads):
    """decode_attention_with_kv_write (one kernel storing each sequence's new K/V, then attending)
    gives the outputs and caches of write_kv then ragged_paged_attention bit for bit: short and
    long contexts (split-K), padding rows, a window and soft cap, an fp8 cache, two query tiles."""
    assert ops.ops_backend() == "cuda"
    num_q_heads, num_kv_heads = heads
    case = _fused_decode_case(np.random.default_rng(5), [1, 37, 4000, 130, 2100], num_q_heads,
                              num_kv_heads, 128, 16, num_padding_rows=2)
    kv = torch.from_numpy(case.pop("kv")).to(torch_cuda, dtype)
    k, v = kv[:, :, 0], kv[:, :, 1]
    args = _torch_args(case, dtype, torch_cuda)
    scales = {}
    if cache == "fp8":
        scales = {"k_scale": 0.5, "v_scale": 0.25}
        for name in ("k_cache", "v_cache"):
            args[name] = (args[name].float() / 2).to(torch.float8_e4m3fn)
    caches = {name: args.pop(name) for name in ("k_cache", "v_cache")}
    slots = args.pop("slot_mapping")
    two = {name: c.clone() for name, c in caches.items()}
    ops.write_kv(k, v, two["k_cache"], two["v_cache"], slots, **scales)
    want = ops.ragged_paged_attention(args["q"], two["k_cache"], two["v_cache"],
                                      args["kv_lens"], args["block_tables"],
                                      args["query_start_loc"], sm_scale=128**-0.5,
                                      max_query_len=1, **scales, **options)
    got = ops.decode_attention_with_kv_write(
        args["q"], k, v, caches["k_cache"], caches["v_cache"], slots, args["kv_lens"],
        args["block_tables"], args["query_start_loc"], sm_scale=128**-0.5, **scales, **options)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(caches[name].view(torch.uint8), two[name].view(torch.uint8))


def test_fused_decode_off_a_gpu_is_the_two_ops():
    """Without the CUDA kernel the fused entry point is write_kv then the attention op (the C++
    ones here): the caches written and the same outputs."""
    case = _fused_decode_case(np.random.default_rng(6), [1, 9, 40], 8, 2, 64, 4,
                              num_padding_rows=1)
    kv = torch.from_numpy(case.pop("kv"))
    k, v = kv[:, :, 0], kv[:, :, 1]
    args = _torch_args(case, torch.float32, _CPU)
    slots = args.pop("slot_mapping")
    two = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    reference.write_kv(k, v, two["k_cache"], two["v_cache"], slots)
    want = reference.ragged_paged_attention(args["q"], two["k_cache"], two["v_cache"],
                                            args["kv_lens"], args["block_tables"],
                                            args["query_start_loc"], sm_scale=0.125)
    got = ops.decode_attention_with_kv_write(
        args["q"], k, v, args["k_cache"], args["v_cache"], slots, args["kv_lens"],
        args["block_tables"], args["query_start_loc"], sm_scale=0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["k_cache"], two["k_cache"])
    torch.testing.assert_close(args["v_cache"], two["v_cache"])
