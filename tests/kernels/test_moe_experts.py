"""The C++ CPU expert block of a mixture of experts (moe_experts_kernel.h) through both bindings,
the torch op pagedjax::moe_experts and the XLA FFI handler: against float64 NumPy math with
tokens routed unevenly, the same bits from both, from any thread count and for a token alone or
in a batch, its errors; and the models' packed expert blocks against their unpacked ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax.backends.jax import cpu_ffi
from pagedjax.kernels_cuda import ops, reference

NUM_EXPERTS = 6  # expert 0 takes every token, expert 5 none


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert ops.ops_backend() == "cpp", "the torch extension must build on the test machines"
    assert cpu_ffi.available(), "the FFI library must build on the test machines"


def make_case(num_tokens: int, top_k: int, hidden: int, inter: int, seed: int = 0) -> dict:
    """x [T, H], each token's k distinct experts (expert 0 among them, expert 5 never, in a
    shuffled order) with softmax-like weights, and the experts' weights as the JAX params hold
    them: gate_up [E, H, 2I] (gate columns, then up), down [E, I, H]."""
    rng = np.random.default_rng(seed)
    ids = np.empty((num_tokens, top_k), np.int32)
    for t in range(num_tokens):
        chosen = [0, *rng.choice(np.arange(1, NUM_EXPERTS - 1), top_k - 1, replace=False)]
        ids[t] = rng.permutation(chosen)
    weights = rng.dirichlet(np.ones(top_k), num_tokens).astype(np.float32)
    return {
        "x": rng.standard_normal((num_tokens, hidden)).astype(np.float32),
        "topk_ids": ids,
        "topk_weights": weights,
        "gate_up": (rng.standard_normal((NUM_EXPERTS, hidden, 2 * inter)) / hidden**0.5
                    ).astype(np.float32),
        "down": (rng.standard_normal((NUM_EXPERTS, inter, hidden)) / inter**0.5
                 ).astype(np.float32),
    }


def naive_moe(case: dict) -> np.ndarray:
    """float64: each token's sum over its experts of weight * (silu(gate) * up) @ down."""
    x, gate_up, down = (case[k].astype(np.float64) for k in ("x", "gate_up", "down"))
    inter = down.shape[1]
    y = np.zeros_like(x)
    for t, (ids, weights) in enumerate(zip(case["topk_ids"], case["topk_weights"])):
        for e, w in zip(ids, weights):
            h = x[t] @ gate_up[e]
            gate, up = h[:inter], h[inter:]
            y[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return y


def torch_packed(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) packed by the torch backend's packer from the checkpoint's [E, out, in]."""
    return ops.pack_moe_weights(torch.from_numpy(case["gate_up"].transpose(0, 2, 1).copy()),
                                torch.from_numpy(case["down"].transpose(0, 2, 1).copy()))


def run_torch(case: dict, ids_dtype: torch.dtype = torch.int32) -> np.ndarray:
    w13, w2 = torch_packed(case)
    return ops.moe_experts(torch.from_numpy(case["x"]),
                           torch.from_numpy(case["topk_ids"]).to(ids_dtype),
                           torch.from_numpy(case["topk_weights"]), w13, w2,
                           case["down"].shape[1]).numpy()


def run_ffi(case: dict, num_rows: int | None = None) -> np.ndarray:
    w13, w2 = cpu_ffi.pack_moe_weights(jnp.asarray(case["gate_up"]), jnp.asarray(case["down"]))
    inter = case["down"].shape[1]
    fn = jax.jit(lambda x, ids, w, w13, w2, n: cpu_ffi.moe_experts(x, ids, w, w13, w2, inter, n))
    n = None if num_rows is None else jnp.int32(num_rows)
    return np.asarray(fn(case["x"], case["topk_ids"], case["topk_weights"], w13, w2, n))


def relative_error(got: np.ndarray, case: dict) -> float:
    want = naive_moe(case)
    scale = np.abs(want).max(axis=-1, keepdims=True) + 1e-3
    return float(np.max(np.abs(got.astype(np.float64) - want) / scale, initial=0.0))


# T, k, H, I: one token to 40, H and I multiples of 16 or not (a tile cut by the gate/up border,
# a partial last tile), tile counts that make groups of 4 and single tiles; 40 tokens x 4
# experts split the products between two threads.
CASES = [(1, 1, 16, 16), (1, 2, 64, 40), (3, 2, 20, 19), (5, 3, 32, 24), (8, 4, 40, 40),
         (17, 2, 48, 33), (40, 4, 64, 40), (40, 1, 96, 64), (23, 3, 19, 7)]


@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "inter"), CASES)
def test_matches_float64_and_both_bindings_give_the_same_bits(num_tokens: int, top_k: int,
                                                              hidden: int, inter: int) -> None:
    case = make_case(num_tokens, top_k, hidden, inter, seed=num_tokens * 10 + top_k)
    counts = np.bincount(case["topk_ids"].ravel(), minlength=NUM_EXPERTS)
    assert counts[0] == num_tokens and counts[-1] == 0  # one expert takes all, one none
    got = run_torch(case)
    assert got.shape == (num_tokens, hidden) and got.dtype == np.float32
    assert relative_error(got, case) < 1e-5
    np.testing.assert_array_equal(run_ffi(case), got)
    np.testing.assert_array_equal(run_torch(case, torch.int64), got)  # torch.topk's ids


def test_the_packers_agree() -> None:
    case = make_case(2, 2, 40, 24)
    w13, w2 = torch_packed(case)
    assert w13.shape == (NUM_EXPERTS, 3, 40, 16) and w2.shape == (NUM_EXPERTS, 3, 24, 16)
    for ours, theirs in zip((w13, w2), cpu_ffi.pack_moe_weights(jnp.asarray(case["gate_up"]),
                                                                 jnp.asarray(case["down"]))):
        np.testing.assert_array_equal(ours.numpy(), np.asarray(theirs))
    for e in range(NUM_EXPERTS):  # each expert as pack_linear_weight packs its [in, out]
        np.testing.assert_array_equal(
            w13[e].numpy(), ops.pack_linear_weight(torch.from_numpy(case["gate_up"][e])).numpy())


def test_a_token_alone_and_any_thread_count_give_the_same_bits() -> None:
    case = make_case(40, 4, 64, 40, seed=7)
    batch = run_torch(case)
    for t in (0, 17, 39):
        alone = {**case, **{k: case[k][t : t + 1] for k in ("x", "topk_ids", "topk_weights")}}
        np.testing.assert_array_equal(run_torch(alone)[0], batch[t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        np.testing.assert_array_equal(run_torch(case), batch)
    finally:
        torch.set_num_threads(threads)


def test_the_reference_is_the_same_math() -> None:
    case = make_case(9, 2, 40, 24, seed=3)
    w13, w2 = torch_packed(case)
    got = reference.moe_experts(torch.from_numpy(case["x"]), torch.from_numpy(case["topk_ids"]),
                                torch.from_numpy(case["topk_weights"]), w13, w2, 24).numpy()
    assert relative_error(got, case) < 1e-5


@pytest.mark.parametrize("num_rows", [0, 1, 7, 11, 20])
def test_the_ffi_computes_the_first_num_rows_only(num_rows: int) -> None:
    """num_rows (the step's real tokens): those rows as without it, the padding rows zeros."""
    case = make_case(11, 2, 32, 24, seed=num_rows)
    full = run_ffi(case)
    got = run_ffi(case, num_rows)
    n = min(num_rows, 11)
    np.testing.assert_array_equal(got[:n], full[:n])
    np.testing.assert_array_equal(got[n:], 0)


def bad_cases() -> list[tuple[str, dict, str]]:
    """(what is wrong, the arguments' changes, the message that names it)."""
    return [
        ("w13 tiles", {"w13": lambda w: w[:, :2]},
         r"w13_packed must be \[num_experts, ceil\(2 \* intermediate_size / 16\)=3, hidden=20, "
         r"16\] \(each expert's gate_up \[H, 2I\] packed\), got shape \[6, 2, 20, 16\]"),
        ("w2 experts", {"w2": lambda w: w[:4]},
         r"w2_packed must be \[num_experts=6, ceil\(hidden / 16\)=2, intermediate_size=24, 16\]"),
        ("ids rows", {"topk_ids": lambda i: i[:2]},
         r"topk_ids must be \[num_tokens=3, top_k >= 1\], got shape \[2, 2\]"),
        ("weights shape", {"topk_weights": lambda w: w[:, :1]},
         r"topk_weights must be topk_ids' \[3, 2\], got shape \[3, 1\]"),
        ("id range", {"topk_ids": lambda i: np.where(np.arange(i.size).reshape(i.shape) == 3, 6,
                                                     i).astype(i.dtype)},
         r"topk_ids\[1, 1\]=6 is no expert; ids must be in \[0, num_experts=6\)"),
    ]


@pytest.mark.parametrize(("what", "change", "message"), bad_cases(),
                         ids=[c[0] for c in bad_cases()])
def test_bad_arguments_raise_naming_the_expected_shapes(what: str, change: dict,
                                                        message: str) -> None:
    case = make_case(3, 2, 20, 24)
    w13, w2 = (w.numpy() for w in torch_packed(case))
    args = {"x": case["x"], "topk_ids": case["topk_ids"], "topk_weights": case["topk_weights"],
            "w13": w13, "w2": w2}
    args.update({name: fn(args[name]) for name, fn in change.items()})
    with pytest.raises(RuntimeError, match="pagedjax::moe_experts: " + message):
        torch.ops.pagedjax.moe_experts(*(torch.from_numpy(np.ascontiguousarray(a))
                                         for a in args.values()), 24)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"moe_experts \(FFI\): " + message):
        cpu_ffi.moe_experts(*(jnp.asarray(a) for a in args.values()), 24).block_until_ready()


def test_other_dtypes_are_refused() -> None:
    case = make_case(2, 2, 16, 16)
    w13, w2 = torch_packed(case)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 tensor, got Double"):
        torch.ops.pagedjax.moe_experts(torch.from_numpy(case["x"]).double(),
                                       torch.from_numpy(case["topk_ids"]),
                                       torch.from_numpy(case["topk_weights"]), w13, w2, 16)
    with pytest.raises(ValueError, match="takes float32; got x bfloat16"):
        cpu_ffi.moe_experts(jnp.asarray(case["x"], jnp.bfloat16), case["topk_ids"],
                            case["topk_weights"], jnp.asarray(w13.numpy()),
                            jnp.asarray(w2.numpy()), 16)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_the_models_packed_expert_blocks_equal_their_unpacked_ones(backend: str) -> None:
    """FusedMoE packed (CPU float32: torch's pack_linears, JAX's pack_params) runs the C++ op:
    the same block as grouped_mm / ragged_dot within float32 noise; JAX's padding rows after
    num_rows are zeros."""
    from tests.model_loader.test_moe import hf_block, moe_config

    hf_config, block, x = hf_block(norm_topk_prob=True, hidden=40, inter=24)
    config = moe_config(hf_config, renormalize=True)
    router = block.gate.weight.detach().T.contiguous()  # [H, E]
    gate_up = block.experts.gate_up_proj.detach()  # [E, 2I, H]
    down = block.experts.down_proj.detach()  # [E, H, I]
    if backend == "torch":
        from pagedjax.backends.torch.linear import Linear
        from pagedjax.backends.torch.moe import FusedMoE
        from pagedjax.backends.torch.parallel import Shard

        outs = []
        for packed in (False, True):
            with torch.device("meta"):
                ours = FusedMoE(config, Shard(), Linear(config.hidden_size, config.num_experts))
            ours.load_state_dict({"router.weight": router, "gate_up_proj": gate_up,
                                  "down_proj": down}, assign=True)
            if packed:
                ours.router.pack()
                ours.pack()
            with torch.no_grad():
                outs.append(ours(x).numpy())
        unpacked, got = outs
    else:
        from pagedjax.backends.jax.model import pack_params
        from pagedjax.backends.jax.moe import FusedMoE

        gate, up = np.split(gate_up.numpy().transpose(0, 2, 1), 2, axis=-1)  # [E, H, I] each
        mlp = {"router": {"kernel": jnp.asarray(router.numpy())},
               "gate_proj": jnp.asarray(gate), "up_proj": jnp.asarray(up),
               "down_proj": jnp.asarray(down.numpy().transpose(0, 2, 1))}
        unpacked = np.asarray(FusedMoE(config, jnp.float32).apply({"params": mlp},
                                                                 jnp.asarray(x.numpy())))
        attn = {name: {"kernel": jnp.zeros((40, 8))}
                for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        packed = pack_params({"params": {"layers_0": {"self_attn": attn, "mlp": mlp}}}, False)
        params = {"params": packed["params"]["layers_0"]["mlp"]}
        assert set(params["params"]) == {"router", "gate_up_packed", "down_packed"}
        got = np.asarray(FusedMoE(config, jnp.float32, packed=True).apply(
            params, jnp.asarray(x.numpy()), jnp.int32(20)))
        np.testing.assert_array_equal(got[20:], 0)
        got, unpacked = got[:20], unpacked[:20]
    np.testing.assert_allclose(got, unpacked, atol=1e-5, rtol=0)
