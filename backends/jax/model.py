"""Llama-family decoder in Flax linen over a paged KV cache: Llama, and the variations other
architectures take of it (pagedjax/model_loader/architectures.py: q/k norms, post-norms,
multipliers).

The model sees one flattened ragged batch: T tokens from S sequences. Attention metadata is
passed explicitly (never a global: jit cannot see globals); KV caches go in and come out so the
jitted step can donate them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.common.weight_quantizer import LM_HEAD, WeightQuantizer, projection_label
from pagedjax.backends.jax.linear import dense, matmul_precision
from pagedjax.backends.jax.moe import ExpertsFn, FusedMoE, routed_experts
from pagedjax.config import ModelConfig

if TYPE_CHECKING:
    from pagedjax.backends.jax.cpu_ffi import DecoderLayerWeights

KVCache = tuple[jax.Array, jax.Array]  # k, v: [num_blocks, Hkv, block_size, D]
# An fp8 KV cache's (k_scale, v_scale) per layer (kv_cache_scales.py); None: the model's dtype
KVCacheScales = tuple[tuple[float, float], ...] | None


# (q [T, Hq, D], k_cache, v_cache, kv_lens, block_tables, query_start_loc, *, sm_scale,
#  sliding_window, soft_cap, decode, k_scale, v_scale) -> [T, Hq, D]
AttentionFn = Callable[..., jax.Array]
# (k [T, Hkv, D], v [T, Hkv, D], k_cache, v_cache, slot_mapping, k_scale, v_scale)
#   -> (k_cache, v_cache)
WriteKVFn = Callable[..., KVCache]
# A decode step's WriteKVFn then AttentionFn in one call (decode_attention.py):
# (q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc, *,
#  sm_scale, sliding_window, soft_cap, k_scale, v_scale) -> (out [T, Hq, D], k_cache, v_cache)
DecodeAttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


class RMSNorm(nn.Module):
    """HF's RMSNorm; with an offset (Gemma's 1 + w) the product is taken in float32 first."""

    eps: float
    dtype: jnp.dtype
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + weight.astype(jnp.float32))).astype(self.dtype)
        return weight * x32.astype(self.dtype)


_FUSED = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}


def pack_params(params: dict, tie_word_embeddings: bool,
                quantizer: WeightQuantizer | None = None) -> dict:
    """{"params": ...} for the packed model: every linear kernel [in, out] packed for
    PackedLinear, q/k/v and gate/up fused into one product each (qkv_proj, gate_up_proj; a
    mixture of experts' experts packed for cpu_ffi.moe_experts as gate_up_packed and
    down_packed, its router for PackedLinear: `experts`), and a
    tied LM head given its own packed copy of the embedding (as "lm_head"). quantizer: each
    fused projection and the head kept as the blocks it gives ("blocks" in place of "kernel";
    backends/common/weight_quantizer.py), packed where it gives none."""
    from pagedjax.backends.jax import cpu_ffi

    def experts(block: dict) -> dict:  # a FusedMoE's params, packed
        gate_up = jnp.concatenate([block["gate_proj"], block["up_proj"]], axis=-1)  # [E, H, 2I]
        w13, w2 = cpu_ffi.pack_moe_weights(gate_up, block["down_proj"])
        router = {"kernel": cpu_ffi.pack_linear_weight(block["router"]["kernel"])}
        return {"router": router, "gate_up_packed": w13, "down_packed": w2}

    def packed(layer: dict, label: str) -> dict:
        kept = quantizer(label, np.asarray(layer["kernel"]).T) if quantizer else None
        if kept is not None:
            out = {"blocks": jnp.asarray(kept[1])}  # [out, in / 32 * block bytes] uint8
        else:
            out = {"kernel": cpu_ffi.pack_linear_weight(layer["kernel"])}
        return {**out, "bias": layer["bias"]} if "bias" in layer else out

    def fuse(block: dict, i: int, fused: str, parts: tuple[str, ...]) -> dict:
        rest = {name: packed(layer, projection_label(i, name)) if "kernel" in layer else layer
                for name, layer in block.items() if name not in parts}  # norms stay
        layers = [block[name] for name in parts]
        kernel = jnp.concatenate([layer["kernel"] for layer in layers], axis=-1)
        joined = {"kernel": kernel}
        if "bias" in layers[0]:
            joined["bias"] = jnp.concatenate([layer["bias"] for layer in layers], axis=-1)
        return {**rest, fused: packed(joined, projection_label(i, fused))}

    tree = dict(params["params"])
    for name, layer in tree.items():
        if name.startswith("layers_"):
            i = int(name.removeprefix("layers_"))
            tree[name] = {**layer, **{
                block: experts(layer[block]) if "router" in layer[block]  # a FusedMoE's
                else fuse(layer[block], i, *_FUSED[block]) for block in _FUSED}}
    if "lm_head" in tree:
        tree["lm_head"] = packed(tree["lm_head"], LM_HEAD)
    elif tie_word_embeddings:
        tree["lm_head"] = packed({"kernel": tree["embed_tokens"]["embedding"].T},  # [H, V]
                                 LM_HEAD)
    if quantizer is not None:
        quantizer.summary()
    return {**params, "params": tree}


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D] rotated by per-token cos/sin [T, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]
    return out.astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    attention_fn: AttentionFn
    write_kv_fn: WriteKVFn
    packed: bool = False
    layer: int = 0  # its index: the window and rope table it uses
    kv_scales: tuple[float, float] = (1.0, 1.0)  # an fp8 cache stores k / k_scale, v / v_scale
    decode_fn: DecodeAttentionFn | None = None  # decode steps' write + attention, fused

    @nn.compact
    def __call__(self, x: jax.Array, kv_cache: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        cfg, num_tokens = self.config, x.shape[0]
        d, hq, hkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads

        def proj(name: str, heads: int) -> jax.Array:
            return dense(heads * d, name, self.dtype, cfg.attention_bias)(x).reshape(
                num_tokens, heads, d)

        if self.packed:  # one product (pack_params fused the kernels)
            qkv = dense((hq + 2 * hkv) * d, "qkv_proj", self.dtype, cfg.attention_bias,
                        packed=True)(x).reshape(num_tokens, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        else:
            q = proj("q_proj", hq)  # [T, Hq, D]
            k = proj("k_proj", hkv)  # [T, Hkv, D]
            v = proj("v_proj", hkv)  # [T, Hkv, D]
        if cfg.qk_norm is not None:  # "head": over each head's D; "full": over all heads
            def norm(name: str, x: jax.Array) -> jax.Array:
                shape = x.shape if cfg.qk_norm == "head" else (num_tokens, -1)
                return RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_weight_offset,
                               name=name)(x.reshape(shape)).reshape(x.shape)

            q, k = norm("q_norm", q), norm("k_norm", k)
        positions = meta.positions
        if cfg.local_rope(self.layer):  # the local table follows the global one
            positions = positions + meta.rope_cos.shape[0] // 2
        cos, sin = meta.rope_cos[positions], meta.rope_sin[positions]  # [T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_scale, v_scale = self.kv_scales
        semantics = dict(sm_scale=cfg.sm_scale, sliding_window=cfg.sliding_window_of(self.layer),
                         soft_cap=cfg.attn_logit_softcapping, k_scale=k_scale, v_scale=v_scale)
        if meta.decode and self.decode_fn is not None:  # one kernel: T == S, row s seq s's
            out, k_cache, v_cache = self.decode_fn(
                q, k, v, *kv_cache, meta.slot_mapping, meta.kv_lens, meta.block_tables,
                meta.query_start_loc, **semantics)  # [T, Hq, D]
        else:
            k_cache, v_cache = self.write_kv_fn(k, v, *kv_cache, meta.slot_mapping,
                                                k_scale=k_scale, v_scale=v_scale)
            out = self.attention_fn(q, k_cache, v_cache, meta.kv_lens, meta.block_tables,
                                    meta.query_start_loc, decode=meta.decode,
                                    **semantics)  # [T, Hq, D]
        out = dense(cfg.hidden_size, "o_proj", self.dtype, packed=self.packed)(
            out.reshape(num_tokens, hq * d))
        return out, (k_cache, v_cache)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    packed: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        inter, dtype, packed = self.config.intermediate_size, self.dtype, self.packed
        if packed:  # one product (pack_params fused the kernels)
            gate_up = dense(2 * inter, "gate_up_proj", dtype, packed=True)(x)
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        else:
            gate, up = dense(inter, "gate_proj", dtype)(x), dense(inter, "up_proj", dtype)(x)
        act = nn.silu(gate) if self.config.hidden_act == "silu" else nn.gelu(gate, approximate=True)
        return dense(self.config.hidden_size, "down_proj", dtype, packed=packed)(act * up)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    attention_fn: AttentionFn
    write_kv_fn: WriteKVFn
    packed: bool = False
    layer: int = 0  # its index
    kv_scales: tuple[float, float] = (1.0, 1.0)
    experts_fn: ExpertsFn = routed_experts  # a mixture of experts' (per device under TP)
    decode_fn: DecodeAttentionFn | None = None  # decode steps' write + attention, fused

    @nn.compact
    def __call__(self, x: jax.Array, kv_cache: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        cfg = self.config
        attention = Attention(cfg, self.dtype, self.attention_fn, self.write_kv_fn, self.packed,
                              self.layer, self.kv_scales, self.decode_fn, name="self_attn")
        if cfg.is_moe_layer(self.layer):  # packed: the padding rows wake no expert
            moe = FusedMoE(cfg, self.dtype, self.packed, self.experts_fn, name="mlp")
            mlp = functools.partial(moe, num_rows=meta.query_start_loc[-1] if self.packed
                                    else None)
        else:
            mlp = MLP(cfg, self.dtype, self.packed, name="mlp")

        def norm(name: str) -> RMSNorm:
            return RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_weight_offset, name=name)

        def residual(h: jax.Array) -> jax.Array:
            return h if cfg.residual_multiplier == 1.0 else h * cfg.residual_multiplier

        if cfg.norm_layout != "pre":  # the sublayers' outputs are normalised (OLMo 2, Gemma)
            sandwich = cfg.norm_layout == "sandwich"  # their inputs too (Gemma)
            h = norm("input_layernorm")(x) if sandwich else x
            h, kv_cache = attention(h, kv_cache, meta)
            x = x + residual(norm("post_attention_layernorm")(h))
            h = mlp(norm("pre_feedforward_layernorm")(x) if sandwich else x)
            return x + residual(norm("post_feedforward_layernorm")(h)), kv_cache
        h, kv_cache = attention(norm("input_layernorm")(x), kv_cache, meta)
        x = x + residual(h)
        return x + residual(mlp(norm("post_attention_layernorm")(x))), kv_cache


class LlamaForCausalLM(nn.Module):
    """`__call__` runs the decoder over the T tokens and returns their hidden states (before
    the final norm); `logits` turns chosen rows of those into logits, so that a step computes
    the LM head only for the rows it samples or scores. packed: the linear layers are
    PackedLinear (params from pack_params)."""

    config: ModelConfig
    dtype: jnp.dtype
    attention_fn: AttentionFn
    write_kv_fn: WriteKVFn
    packed: bool = False
    kv_cache_scales: KVCacheScales = None  # not None: the KV cache is float8_e4m3fn
    experts_fn: ExpertsFn = routed_experts  # a mixture of experts' (per device under TP)
    decode_fn: DecodeAttentionFn | None = None  # decode steps' write + attention, fused

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.layers = [DecoderLayer(cfg, self.dtype, self.attention_fn, self.write_kv_fn,
                                    self.packed, i, self.layer_kv_scales(i), self.experts_fn,
                                    self.decode_fn)
                       for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_weight_offset)
        # packed and tied: pack_params gives the head its own copy of the embedding
        if not cfg.tie_word_embeddings or self.packed:
            self.lm_head = dense(cfg.vocab_size, None, self.dtype, packed=self.packed)

    def __call__(self, input_ids: jax.Array, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> tuple[jax.Array, list[KVCache]]:
        """input_ids [T] → (hidden states [T, H], the updated KV caches)."""
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        if self.fused_layers:
            return self._fused_layers(x, kv_caches, meta)
        new_caches = []
        for layer, cache in zip(self.layers, kv_caches):
            x, cache = layer(x, cache, meta)
            new_caches.append(cache)
        return x, new_caches

    @property
    def kv_cache_dtype(self) -> jnp.dtype:
        """The KV caches' dtype: float8_e4m3fn with kv_cache_scales, else the model's."""
        return jnp.dtype(jnp.float8_e4m3fn if self.kv_cache_scales else self.dtype)

    def layer_kv_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of one layer's fp8 cache; (1, 1) for a cache of the model dtype."""
        return (1.0, 1.0) if self.kv_cache_scales is None else self.kv_cache_scales[layer]

    @property
    def fused_layers(self) -> bool:
        """Each decoder layer one C++ call (`cpu_ffi.decoder_layer`): packed, a layer the call
        computes (ModelConfig.fusable_decoder_layer), one rope table."""
        cfg = self.config
        return (self.packed and cfg.fusable_decoder_layer
                and not any(cfg.local_rope(i) for i in range(cfg.num_layers)))

    def _fused_layers(self, x: jax.Array, kv_caches: list[KVCache],
                      meta: AttentionMetadata) -> tuple[jax.Array, list[KVCache]]:
        """The decoder over x [T, H] (the embedding) with the layers' own parameters, each layer
        one `cpu_ffi.decoder_layer` call → (hidden states [T, H], the updated KV caches)."""
        from pagedjax.backends.jax import cpu_ffi

        cfg, params = self.config, self.variables["params"]
        cos, sin = meta.rope_cos[meta.positions], meta.rope_sin[meta.positions]  # [T, D]
        residual, new_caches = None, []
        for i, cache in enumerate(kv_caches):
            moe = cfg.is_moe_layer(i)
            x, residual, cache = cpu_ffi.decoder_layer(
                x, residual, self._fused_weights(params[f"layers_{i}"]), cache, cos, sin,
                meta.slot_mapping, meta.kv_lens, meta.block_tables, meta.query_start_loc,
                num_q_heads=cfg.num_q_heads,
                intermediate_size=cfg.moe_intermediate_size if moe else cfg.intermediate_size,
                eps=cfg.rms_norm_eps, sm_scale=cfg.sm_scale,
                sliding_window=cfg.sliding_window_of(i), k_scale=self.layer_kv_scales(i)[0],
                v_scale=self.layer_kv_scales(i)[1], top_k=cfg.num_experts_per_tok if moe else 0,
                renormalize=cfg.renormalize_topk)
            new_caches.append(cache)
        return x + residual, new_caches

    @staticmethod
    def _fused_weights(layer: dict) -> DecoderLayerWeights:
        """One layer's packed params (pack_params) as `cpu_ffi.decoder_layer` takes them."""
        from pagedjax.backends.jax import cpu_ffi

        attn, mlp = layer["self_attn"], layer["mlp"]
        weight = lambda p: p.get("kernel", p.get("blocks"))  # packed, or kept as blocks
        if "router" in mlp:  # a FusedMoE's: the experts in gate_up's and down's place
            gate_up, down = mlp["gate_up_packed"], mlp["down_packed"]
            moe = {"router": mlp["router"]["kernel"]}
        else:
            gate_up, down, moe = weight(mlp["gate_up_proj"]), weight(mlp["down_proj"]), {}
        norms = ({"q_norm": attn["q_norm"]["weight"], "k_norm": attn["k_norm"]["weight"]}
                 if "q_norm" in attn else {})
        return cpu_ffi.DecoderLayerWeights(
            layer["input_layernorm"]["weight"], weight(attn["qkv_proj"]),
            attn["qkv_proj"].get("bias", jnp.zeros(0, jnp.float32)), weight(attn["o_proj"]),
            layer["post_attention_layernorm"]["weight"], gate_up, down, **norms, **moe)

    def logits(self, hidden: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """hidden [R, H] (rows of __call__'s output) → float32 logits [R, V]. num_rows (int32
        scalar): the rows after it are padding, whose logits the packed (CPU) head leaves at
        zero instead of computing them; None: every row is real."""
        x = self.norm(hidden)
        if self.config.tie_word_embeddings and not self.packed:
            logits = jnp.dot(x, self.embed_tokens.embedding.T,
                             precision=matmul_precision(self.dtype))
        elif self.packed:
            logits = self.lm_head(x, num_rows)
        else:
            logits = self.lm_head(x)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
