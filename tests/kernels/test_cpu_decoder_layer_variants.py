"""The fused CPU decoder layer over Qwen3's per-head q/k norms and mixture-of-experts MLPs (Qwen3,
Qwen3-MoE with its dense layers, Mixtral): the torch op `pagedjax::decoder_layer` computes the
torch layer module's op-by-op bits, and the JAX FFI handler the torch op's, at decode rows,
prefill rows and padding rows; and the routing both paths share (`pagedjax::moe_routing`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.jax import cpu_ffi
from pagedjax.backends.torch.attention import resolve_attention
from pagedjax.backends.torch.linear import Linear
from pagedjax.backends.torch.model import DecoderLayer
from pagedjax.backends.torch.moe import FusedMoE
from pagedjax.backends.torch.parallel import Shard
from pagedjax.config import ModelConfig
from pagedjax.kernels_cuda import ops, reference
from tests.kernels.test_cpu_decoder_layer import EPS, _case

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "rms_norm_eps": EPS, "max_position_embeddings": 64, "head_dim": 16}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True,
             "mlp_only_layers": [0]}
LAYERS = {  # name: (config.json over BASE, the layer's index)
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"]}, 0),
    "qwen3-moe": (QWEN3_MOE, 1),
    "qwen3-moe-dense-layer": (QWEN3_MOE, 0),  # mlp_only_layers
    "mixtral": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                 "num_experts_per_tok": 2, "intermediate_size": 40}, 0),
    # 6 experts (the router's tile padded), k = 3, 2 I = 40 (the experts' tiles padded)
    "qwen3-moe-odd": ({**QWEN3_MOE, "num_experts": 6, "num_experts_per_tok": 3,
                       "moe_intermediate_size": 20, "norm_topk_prob": False}, 1),
}
BATCHES = {  # name: (q_lens, kv_lens, padding rows)
    "decode": ((1, 1, 1), (17, 1, 30), 0),
    "prefill": ((9, 4), (9, 30), 0),
    "padding": ((1, 9, 4), (17, 9, 30), 3),
}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert ops.ops_backend() == "cpp", "the torch C++ ops must build on the test machines"
    assert cpu_ffi.available(), "the FFI library must build on the test machines (g++ is there)"


def _layer(name: str) -> DecoderLayer:
    """The torch layer module of LAYERS[name] with random weights, packed (CPU float32)."""
    fields, index = LAYERS[name]
    config = ModelConfig.from_dict({**BASE, **fields})
    layer = DecoderLayer(config, resolve_attention("auto"), Shard(), index)
    generator = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for param_name, param in layer.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:  # a Linear's [in, out], or the experts' [E, out, in]
                fan_in = param.shape[-1] if param.dim() == 3 else param.shape[0]
                param.copy_(torch.randn(param.shape, generator=generator) * fan_in**-0.5)
    for module in layer.modules():
        if isinstance(module, (Linear, FusedMoE)):
            module.pack()
    return layer


def _batch(layer: DecoderLayer, batch: str) -> dict:
    cfg = layer.config
    q_lens, kv_lens, padding = BATCHES[batch]
    return _case(np.random.default_rng(len(batch)), hidden=cfg.hidden_size,
                 num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                 head_dim=cfg.head_dim, intermediate=8, bias=False, q_lens=q_lens,
                 kv_lens=kv_lens, num_padding_rows=padding)


def _torch_layer(layer: DecoderLayer, c: dict, fused: bool) -> tuple[np.ndarray, ...]:
    """(out, stream, k_cache, v_cache) of the module op by op, or fused into one op."""
    layer.fused = False
    if fused:
        layer.fuse()
        assert layer.fused
    t = {k: torch.from_numpy(v.copy()) for k, v in c.items() if isinstance(v, np.ndarray)}
    meta = AttentionMetadata(None, t["slot_mapping"], t["query_start_loc"], t["kv_lens"],
                             t["block_tables"], None, None,
                             max_query_len=int(np.diff(c["query_start_loc"]).max()))
    with torch.no_grad():
        out, stream = layer(t["x"], t["residual"], t["cos"], t["sin"],
                            (t["k_cache"], t["v_cache"]), meta)
    return out.numpy(), stream.numpy(), t["k_cache"].numpy(), t["v_cache"].numpy()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", LAYERS)
def test_the_fused_layer_is_the_modules_bits(name: str, batch: str) -> None:
    """The same kernels in the same order as the layer's modules (q/k norms, router, routing,
    experts included): every row's bits, padding rows too, and the same cache writes."""
    layer = _layer(name)
    c = _batch(layer, batch)
    unfused = _torch_layer(layer, c, fused=False)
    fused = _torch_layer(layer, c, fused=True)
    for got, want in zip(fused, unfused, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.abs(fused[0]).max() > 0


def _ffi_layer(layer: DecoderLayer, c: dict) -> tuple[np.ndarray, ...]:
    """The JAX FFI layer over the module's packed weights (jitted, the caches donated)."""
    cfg, attn, mlp = layer.config, layer.self_attn, layer.mlp
    arr = lambda t: jnp.asarray(t.detach().numpy())  # noqa: E731
    moe = isinstance(mlp, FusedMoE)
    if moe:
        gate_up, down, extra = arr(mlp.gate_up_proj), arr(mlp.down_proj), {
            "router": arr(mlp.router.weight)}
    else:
        gate_up, down, extra = arr(mlp.gate_up_proj.weight), arr(mlp.down_proj.weight), {}
    if cfg.qk_norm:
        extra.update(q_norm=arr(attn.q_norm.weight), k_norm=arr(attn.k_norm.weight))
    weights = cpu_ffi.DecoderLayerWeights(
        arr(layer.input_layernorm.weight), arr(attn.qkv_proj.weight), jnp.zeros(0, jnp.float32),
        arr(attn.o_proj.weight), arr(layer.post_attention_layernorm.weight), gate_up, down,
        **extra)

    def run(x, residual, k_cache, v_cache, cos, sin, slot_mapping, kv_lens, block_tables,
            query_start_loc):
        out, stream, (k_cache, v_cache) = cpu_ffi.decoder_layer(
            x, residual, weights, (k_cache, v_cache), cos, sin, slot_mapping, kv_lens,
            block_tables, query_start_loc, num_q_heads=cfg.num_q_heads,
            intermediate_size=mlp.intermediate_size, eps=EPS, sm_scale=cfg.sm_scale,
            top_k=mlp.top_k if moe else 0, renormalize=moe and mlp.renormalize)
        return out, stream, k_cache, v_cache

    names = ("x", "residual", "k_cache", "v_cache", "cos", "sin", "slot_mapping", "kv_lens",
             "block_tables", "query_start_loc")
    outs = jax.jit(run, donate_argnums=(2, 3))(*(jnp.asarray(c[n]) for n in names))
    return tuple(np.asarray(x) for x in outs)


@pytest.mark.parametrize("name", LAYERS)
def test_the_ffi_layer_is_the_torch_ops_bits(name: str) -> None:
    """The JAX backend's fused layer computes the torch op's bits (so the two backends' CPU
    paths compute one model); the padding rows it leaves at zero, as its packed MLP does."""
    layer = _layer(name)
    c = _batch(layer, "padding")
    got = _ffi_layer(layer, c)
    want = _torch_layer(layer, c, fused=True)
    real = int(c["query_start_loc"][-1])
    for i in (0, 1):
        np.testing.assert_array_equal(got[i][:real], want[i][:real])
        np.testing.assert_array_equal(got[i][real:], 0)
    for i in (2, 3):
        np.testing.assert_array_equal(got[i], want[i])


def test_moe_routing_is_the_softmax_top_k() -> None:
    """pagedjax::moe_routing: the reference's experts, weights within rounding, renormalised
    or not; ties go to the lower expert (jax.lax.top_k's order), and each weight appears once
    at its place, largest first."""
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(3)) * 3
    for renormalize in (False, True):
        weights, ids = ops.moe_routing(logits, 3, renormalize)
        want_weights, want_ids = reference.moe_routing(logits, 3, renormalize)
        assert ids.dtype == want_ids.dtype == torch.int64
        torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
        torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)
    tied = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = ops.moe_routing(tied, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    _, jax_ids = jax.lax.top_k(jax.nn.softmax(jnp.asarray(tied.numpy()), axis=-1), 2)
    assert np.asarray(jax_ids).tolist() == ids.tolist()
    with pytest.raises(RuntimeError, match=r"top_k=6 must be in \[1, num_experts=5\]"):
        ops.moe_routing(tied, 6, True)
