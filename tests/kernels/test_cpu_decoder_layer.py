"""The JAX backend's fused CPU decoder layer (`cpu_ffi.decoder_layer`, one XLA FFI call a layer)
against a float64 NumPy layer over the attention oracle, and bit for bit against the torch op
`pagedjax::decoder_layer` it mirrors; its KV writes land at the slots and nowhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.backends.jax import cpu_ffi
from tests.kernels.naive import make_ragged_case, naive_ragged_paged_attention

EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_ffi.available(), "the FFI library must build on the test machines (g++ is there)"


def _case(rng: np.random.Generator, *, hidden: int, num_q_heads: int, num_kv_heads: int,
          head_dim: int, intermediate: int, bias: bool, q_lens: tuple[int, ...] = (1, 1, 9, 4),
          kv_lens: tuple[int, ...] = (17, 1, 9, 30), num_padding_rows: int = 1) -> dict:
    """A ragged batch (by default decodes, a prefill, a chunk over a cached prefix, a padding
    row) with random layer weights, caches, rope rows and the slots of each query token."""
    ragged = make_ragged_case(rng, list(q_lens), list(kv_lens), num_q_heads=num_q_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=8,
                              num_padding_rows=num_padding_rows)
    slots = []
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for pos in range(kv_len - q_len, kv_len):
            slots.append(ragged["block_tables"][s, pos // 8] * 8 + pos % 8)
    num_tokens = ragged["q"].shape[0]
    slots += [-1] * (num_tokens - len(slots))
    angles = rng.uniform(0, 6.3, (num_tokens, head_dim // 2))
    qkv_out = (num_q_heads + 2 * num_kv_heads) * head_dim

    def w(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(np.float32)

    return dict(
        x=rng.standard_normal((num_tokens, hidden)).astype(np.float32),
        residual=rng.standard_normal((num_tokens, hidden)).astype(np.float32),
        input_norm=rng.uniform(0.5, 1.5, hidden).astype(np.float32),
        qkv=w(hidden, qkv_out, scale=3.0),
        qkv_bias=(rng.standard_normal(qkv_out).astype(np.float32) if bias
                  else np.zeros(0, np.float32)),
        o=w(num_q_heads * head_dim, hidden),
        post_norm=rng.uniform(0.5, 1.5, hidden).astype(np.float32),
        gate_up=w(hidden, 2 * intermediate),
        down=w(intermediate, hidden),
        k_cache=ragged["k_cache"], v_cache=ragged["v_cache"],
        cos=np.cos(np.concatenate([angles, angles], 1)).astype(np.float32),
        sin=np.sin(np.concatenate([angles, angles], 1)).astype(np.float32),
        slot_mapping=np.asarray(slots, np.int32), kv_lens=ragged["kv_lens"],
        block_tables=ragged["block_tables"], query_start_loc=ragged["query_start_loc"],
        num_q_heads=num_q_heads, intermediate_size=intermediate)


def _reference(c: dict, first: bool, sliding_window: int | None) -> tuple[np.ndarray, ...]:
    """The layer in float64: (out, stream, k_cache, v_cache)."""
    f64 = {k: np.asarray(v, np.float64) if isinstance(v, np.ndarray) else v for k, v in c.items()}

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS)

    def rope(x: np.ndarray) -> np.ndarray:  # [T, heads, D]
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * f64["cos"][:, None] + rotated * f64["sin"][:, None]

    num_tokens, hq = c["x"].shape[0], c["num_q_heads"]
    hkv, d = c["k_cache"].shape[1], c["k_cache"].shape[3]
    stream = f64["x"] if first else f64["x"] + f64["residual"]
    qkv = rms_norm(stream, f64["input_norm"]) @ f64["qkv"]
    if c["qkv_bias"].size:
        qkv = qkv + f64["qkv_bias"]
    qkv = qkv.reshape(num_tokens, hq + 2 * hkv, d)
    q, k, v = rope(qkv[:, :hq]), rope(qkv[:, hq : hq + hkv]), qkv[:, hq + hkv :]
    k_cache, v_cache = f64["k_cache"].copy(), f64["v_cache"].copy()
    for t, slot in enumerate(c["slot_mapping"]):
        if slot >= 0:
            k_cache[slot // 8, :, slot % 8], v_cache[slot // 8, :, slot % 8] = k[t], v[t]
    attn = naive_ragged_paged_attention(q, k_cache, v_cache, c["kv_lens"], c["block_tables"],
                                        c["query_start_loc"], sm_scale=d**-0.5,
                                        sliding_window=sliding_window)
    stream = stream + attn.reshape(num_tokens, -1) @ f64["o"]
    gate, up = np.split(rms_norm(stream, f64["post_norm"]) @ f64["gate_up"], 2, axis=-1)
    out = (gate / (1 + np.exp(-gate)) * up) @ f64["down"]
    return out, stream, k_cache, v_cache


def _run(c: dict, first: bool, sliding_window: int | None,
         blocks: dict | None = None) -> tuple[np.ndarray, ...]:
    """The FFI layer, jitted with the caches donated (as the engine's step runs it). blocks:
    projections kept as GGML blocks (uint8 [out, in / 32 * bytes]) instead of packed."""
    blocks = blocks or {}
    packed = {name: jnp.asarray(blocks[name]) if name in blocks else
              cpu_ffi.pack_linear_weight(jnp.asarray(c[name]))
              for name in ("qkv", "o", "gate_up", "down")}
    weights = cpu_ffi.DecoderLayerWeights(
        jnp.asarray(c["input_norm"]), packed["qkv"], jnp.asarray(c["qkv_bias"]), packed["o"],
        jnp.asarray(c["post_norm"]), packed["gate_up"], packed["down"])

    def layer(x, residual, k_cache, v_cache, cos, sin, slot_mapping, kv_lens, block_tables,
              query_start_loc):
        out, stream, (k_cache, v_cache) = cpu_ffi.decoder_layer(
            x, None if first else residual, weights, (k_cache, v_cache), cos, sin, slot_mapping,
            kv_lens, block_tables, query_start_loc, num_q_heads=c["num_q_heads"],
            intermediate_size=c["intermediate_size"], eps=EPS,
            sm_scale=c["k_cache"].shape[3] ** -0.5, sliding_window=sliding_window)
        return out, stream, k_cache, v_cache

    names = ("x", "residual", "k_cache", "v_cache", "cos", "sin", "slot_mapping", "kv_lens",
             "block_tables", "query_start_loc")
    outs = jax.jit(layer, donate_argnums=(2, 3))(*(jnp.asarray(c[n]) for n in names))
    return tuple(np.asarray(x) for x in outs)


CASES = {  # name: (hidden, Hq, Hkv, D, intermediate, bias, first layer, sliding window)
    "llama": (64, 4, 2, 16, 96, False, False, None),
    "first-layer": (64, 4, 2, 16, 96, False, True, None),
    "qwen2-bias-mha": (48, 3, 3, 16, 80, True, False, None),
    "mistral-window": (64, 8, 2, 8, 128, False, False, 5),
    "odd-widths": (40, 2, 1, 20, 36, True, False, None),  # H, 2 I not multiples of 16
}


@pytest.mark.parametrize("name", CASES)
def test_decoder_layer_matches_the_float64_layer(name: str) -> None:
    hidden, hq, hkv, d, inter, bias, first, window = CASES[name]
    c = _case(np.random.default_rng(len(name)), hidden=hidden, num_q_heads=hq,
              num_kv_heads=hkv, head_dim=d, intermediate=inter, bias=bias)
    out, stream, k_cache, v_cache = _run(c, first, window)
    want = _reference(c, first, window)
    real = int(c["query_start_loc"][-1])  # rows past it are padding: not computed, zeros
    for got, ref in zip((out, stream), want[:2]):
        scale = np.abs(ref[:real]).max()
        np.testing.assert_allclose(got[:real], ref[:real], rtol=0, atol=2e-5 * scale)
        np.testing.assert_array_equal(got[real:], 0)
    written = np.zeros(k_cache.shape[0] * 8, bool)
    written[c["slot_mapping"][c["slot_mapping"] >= 0]] = True
    written = written.reshape(-1, 8)  # [N, bs]
    for got, ref, before in zip((k_cache, v_cache), want[2:], (c["k_cache"], c["v_cache"])):
        np.testing.assert_allclose(got.transpose(0, 2, 1, 3)[written],
                                   ref.transpose(0, 2, 1, 3)[written], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.transpose(0, 2, 1, 3)[~written],
                                      before.transpose(0, 2, 1, 3)[~written])


@pytest.mark.parametrize("first", [False, True])
def test_decoder_layer_is_the_torch_ops_bit_for_bit(first: bool) -> None:
    """The same kernels in the same order as `pagedjax::decoder_layer`: the same bits, so the
    two backends' CPU paths compute one model."""
    torch = pytest.importorskip("torch")
    from pagedjax.kernels_cuda import ops

    assert ops.ops_backend() == "cpp", "the torch C++ ops must build where the FFI library does"
    c = _case(np.random.default_rng(7), hidden=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
              intermediate=96, bias=True)
    got = _run(c, first, 6)
    t = {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in c.items()}
    packed = {n: ops.pack_linear_weight(t[n]) for n in ("qkv", "o", "gate_up", "down")}
    out, stream = torch.ops.pagedjax.decoder_layer(
        t["x"], None if first else t["residual"], t["input_norm"], packed["qkv"], t["qkv_bias"],
        packed["o"], t["post_norm"], packed["gate_up"], packed["down"], t["k_cache"],
        t["v_cache"], t["cos"], t["sin"], t["slot_mapping"], t["kv_lens"], t["block_tables"],
        t["query_start_loc"], 4, 2, 96, EPS, 16**-0.5, 6, None)
    real = int(c["query_start_loc"][-1])
    np.testing.assert_array_equal(got[0][:real], out.numpy()[:real])
    np.testing.assert_array_equal(got[1][:real], stream.numpy()[:real])
    np.testing.assert_array_equal(got[2], t["k_cache"].numpy())
    np.testing.assert_array_equal(got[3], t["v_cache"].numpy())


@pytest.mark.parametrize("q_lens,kv_lens", [((1, 1, 9, 4), (17, 1, 9, 30)),
                                             ((1, 1, 60, 4), (17, 1, 60, 30))])
def test_a_layer_over_quantized_blocks_is_the_torch_ops_bits(q_lens, kv_lens) -> None:
    """Projections kept as GGML blocks of three types beside a packed one: the FFI layer reads
    them as the torch op does (quantization="int8" / "gguf" on the JAX backend), in GGUF's rows
    and interleaved in groups of 8 rows (what the backends keep) alike; a step of 15 rows (the
    integer dots) and one of 66 (dequantized tiles). No padding row: the torch op computes one,
    the FFI layer does not, and the rows of x choose the blocks' path."""
    torch = pytest.importorskip("torch")
    from pagedjax.backends.common import quantization as quant
    from pagedjax.kernels_cuda import ops

    c = _case(np.random.default_rng(9), hidden=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
              intermediate=96, bias=False, q_lens=q_lens, kv_lens=kv_lens, num_padding_rows=0)
    kinds = {"qkv": "Q8_0", "o": "Q4_0", "gate_up": "Q4_1"}  # down stays packed float32
    blocks = {n: quant.QUANTIZERS[kind](c[n].T) for n, kind in kinds.items()}  # [out, bytes]
    got = _run(c, False, None, blocks)
    t = {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in c.items()}
    weight = {n: torch.from_numpy(blocks[n]) for n in kinds}
    out, stream = torch.ops.pagedjax.decoder_layer(
        t["x"], t["residual"], t["input_norm"], weight["qkv"], None, weight["o"],
        t["post_norm"], weight["gate_up"], ops.pack_linear_weight(t["down"]), t["k_cache"],
        t["v_cache"], t["cos"], t["sin"], t["slot_mapping"], t["kv_lens"], t["block_tables"],
        t["query_start_loc"], 4, 2, 96, EPS, 16**-0.5, None, None,
        [quant.QTYPE_OF[kinds[n]] if n in kinds else 0 for n in ("qkv", "o", "gate_up", "down")])
    real = int(c["query_start_loc"][-1])
    np.testing.assert_array_equal(got[0][:real], out.numpy()[:real])
    np.testing.assert_array_equal(got[1][:real], stream.numpy()[:real])
    np.testing.assert_array_equal(got[2], t["k_cache"].numpy())
    grouped = {n: quant.interleave_rows(b, quant.QTYPE_OF[kinds[n]]) for n, b in blocks.items()}
    for a, b in zip(_run(c, False, None, grouped), got, strict=True):
        np.testing.assert_array_equal(a[:real], b[:real])
    # blocks of another width or height are refused by name, not read past their end
    with pytest.raises(ValueError, match=r"\(64, 18\) are no blocks of a kept type"):
        _run(c, False, None, {**blocks, "o": blocks["o"][:, :-18]})
    with pytest.raises(Exception, match=r"o_weight of qtype 2 must be uint8 blocks \[64, 36\]"):
        _run(c, False, None, {**blocks, "o": blocks["o"][:-1]})


def test_the_jax_model_fuses_the_layers_the_call_computes() -> None:
    """Llama-shaped layers of a packed model, with Qwen3's per-head q/k norms or experts too,
    run as one FFI call each; a layer with anything else (here OLMo 2's whole-projection q/k
    norms after the sublayers, Granite-MoE's multipliers) stays XLA's ops."""
    from pagedjax.backends.jax.model import LlamaForCausalLM
    from pagedjax.config import ModelConfig

    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
            "rms_norm_eps": EPS, "max_position_embeddings": 64, "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "residual_multiplier": 0.5}
    config = lambda arch: ModelConfig.from_dict({**base, "architectures": [arch]})  # noqa: E731
    make = lambda arch, packed: LlamaForCausalLM(config(arch), jnp.float32, None, None, packed)  # noqa: E731
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "MixtralForCausalLM"):
        assert make(arch, True).fused_layers, arch
    assert not make("LlamaForCausalLM", False).fused_layers
    for arch in ("Olmo2ForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM"):
        assert not make(arch, True).fused_layers, arch
