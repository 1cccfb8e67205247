"""Llama-family decoder in PyTorch over a paged KV cache: Llama, and the variations other
architectures take of it (pagedjax/model_loader/architectures.py: q/k norms, post-norms,
multipliers).

The model sees one flattened ragged batch: T tokens from S sequences. Attention metadata is
passed explicitly (never a global), as in the JAX model; the KV caches are written in place by
`write_kv` and read by `ragged_paged_attention`. q/k/v and gate/up projections are fused into one
matmul each (their weights concatenated at load time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.common.weight_quantizer import (
    LM_HEAD,
    WeightQuantizer,
    projection_label,
)
from pagedjax.backends.common.weights import layer_norm_names
from pagedjax.backends.torch.linear import Linear
from pagedjax.backends.torch.moe import FusedMoE
from pagedjax.backends.torch.parallel import Shard
from pagedjax.config import ModelConfig
from pagedjax.kernels_cuda import (
    fused_add_rms_norm,
    ops_backend,
    rms_norm,
    silu_and_mul,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, Hkv, block_size, D]
# (q [T, Hq, D], k_cache, v_cache, kv_lens, block_tables, query_start_loc, *, sm_scale,
#  sliding_window, soft_cap, max_query_len) -> [T, Hq, D]
AttentionFn = Callable[..., torch.Tensor]
# (k [T, Hkv, D], v [T, Hkv, D], k_cache, v_cache, slot_mapping) -> None, caches written in place
WriteKVFn = Callable[..., None]
# (x [T, H, D], cos [T, D], sin [T, D]) -> None: x rotated in place (HF's rotate_half, float32)
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# (q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc, *, sm_scale,
#  sliding_window, soft_cap, k_scale, v_scale) -> [T, Hq, D]: a decode step's write_kv + attention
DecodeAttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LayerOps:
    """The custom ops an attention layer calls: pagedjax's C++/CUDA ops or their references."""

    attention: AttentionFn
    write_kv: WriteKVFn
    rotary: RotaryFn
    decode: DecodeAttentionFn | None = None  # a decode step's write + attention, fused


class RMSNorm(nn.Module):
    """As HF: variance in float32, normalised x cast back to the input dtype, then * weight;
    with an offset (Gemma's 1 + w), times (offset + weight) in float32, then cast.
    Given the residual stream too, it adds x to it first: (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.offset:
            if residual is not None:
                residual = x + residual
                return self._offset_norm(residual), residual
            return self._offset_norm(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def _offset_norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    """Column-parallel q/k/v (this shard's heads), row-parallel o_proj (all-reduced)."""

    def __init__(self, config: ModelConfig, ops: LayerOps, shard: Shard, layer: int) -> None:
        super().__init__()
        self.config, self.shard, self.ops = config, shard, ops
        self.sliding_window = config.sliding_window_of(layer)
        d = config.head_dim
        self.num_q_heads = shard.part(config.num_q_heads)
        self.num_kv_heads = shard.part(config.num_kv_heads)
        self.sizes = [self.num_q_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), bias=config.attention_bias)
        self.o_proj = Linear(self.num_q_heads * d, config.hidden_size)
        # An fp8 KV cache's scales (kv_cache_scales.py): it stores k / k_scale, v / v_scale
        self.k_scale, self.v_scale = 1.0, 1.0
        if config.qk_norm is not None:  # "head": over each head's D; "full": over all heads
            q_size, k_size = (d, d) if config.qk_norm == "head" else self.sizes[:2]
            self.q_norm = RMSNorm(q_size, config.rms_norm_eps, config.norm_weight_offset)
            self.k_norm = RMSNorm(k_size, config.rms_norm_eps, config.norm_weight_offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cfg, num_tokens = self.config, x.shape[0]
        d = cfg.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split(self.sizes, dim=-1)
        if cfg.qk_norm is None:  # q and k rotated in place, in one call
            num_qk = self.num_q_heads + self.num_kv_heads
            self.ops.rotary(qkv[:, : num_qk * d].view(num_tokens, num_qk, d), cos, sin)
        else:
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
            self.ops.rotary(q.view(num_tokens, -1, d), cos, sin)
            self.ops.rotary(k.view(num_tokens, -1, d), cos, sin)
        q, k, v = (t.view(num_tokens, -1, d) for t in (q, k, v))
        # k, v [T, Hkv, D]
        semantics = dict(sm_scale=cfg.sm_scale, sliding_window=self.sliding_window,
                         soft_cap=cfg.attn_logit_softcapping, k_scale=self.k_scale,
                         v_scale=self.v_scale)
        if self.ops.decode is not None and meta.max_query_len == 1:  # write + attend, one kernel
            out = self.ops.decode(q, k, v, *kv_cache, meta.slot_mapping, meta.kv_lens,
                                  meta.block_tables, meta.query_start_loc, **semantics)
        else:
            self.ops.write_kv(k, v, *kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            out = self.ops.attention(q, *kv_cache, meta.kv_lens, meta.block_tables,
                                     meta.query_start_loc, max_query_len=meta.max_query_len,
                                     **semantics)
        # out [T, Hq, D]
        return self.shard.all_reduce(self.o_proj(out.reshape(num_tokens, -1)))

    @staticmethod
    def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x [T, H * D] (a view of the qkv product) normalised by rows of norm's width → a new
        contiguous [T, H * D]."""
        width = norm.weight.shape[0]
        return norm(x.reshape(-1, width).contiguous()).view(x.shape[0], -1)


class MLP(nn.Module):
    """Column-parallel gate/up, row-parallel down (all-reduced)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.shard, self.hidden_act = shard, config.hidden_act
        inter = self.intermediate_size = shard.part(config.intermediate_size)
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter)
        self.down_proj = Linear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.hidden_act == "silu":
            h = silu_and_mul(gate_up)
        else:  # gelu_tanh
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        return self.shard.all_reduce(self.down_proj(h))


class VocabEmbedding(nn.Module):
    """The embedding rows of this shard's vocabulary range; other ids embed to zero and the
    ranks' sums (all-reduce) give every token its row."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.start, end = shard.vocab_range(vocab_size)
        self.split = (self.start, end) != (0, vocab_size)
        self.weight = nn.Parameter(torch.empty(end - self.start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.shard.all_reduce(x * inside[:, None].to(x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps, shard: Shard, layer: int) -> None:
        super().__init__()
        self.config = config
        self.local_rope = config.local_rope(layer)  # rotates by the local table (Gemma 3)
        for name in layer_norm_names(config):
            if name not in ("q_norm", "k_norm"):  # those are the attention's
                setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps,
                                            config.norm_weight_offset))
        self.self_attn = Attention(config, ops, shard, layer)
        self.mlp = (FusedMoE(config, shard, Linear(config.hidden_size, config.num_experts))
                    if config.is_moe_layer(layer) else MLP(config, shard))
        self.fused = False  # the whole layer as one C++ op (`fuse`)
        self.qtypes: list[int] | None = None  # its projections' GGML types (None: all packed)

    def fuse(self) -> None:
        """Run the layer as `pagedjax::decoder_layer` (CPU, float32, one device; projections
        packed or kept quantized, a mixture of experts' packed): the same ops in the same order,
        with one call from Python instead of ~12-14 plus their glue."""
        if isinstance(self.mlp, FusedMoE) and not self.mlp.packed:
            return
        self.fused = True
        projections = (self.self_attn.qkv_proj, self.self_attn.o_proj,
                       *((self.mlp.gate_up_proj, self.mlp.down_proj)
                         if isinstance(self.mlp, MLP) else ()))
        qtypes = [p.qtype or 0 for p in projections]
        self.qtypes = qtypes + [0] * (4 - len(qtypes)) if any(qtypes) else None
        self._op_arguments = self._fixed_op_arguments()

    def _fixed_op_arguments(self) -> tuple[tuple, tuple, tuple, Attention]:
        """The op's arguments that stay the same from step to step (weights, sizes), read once
        (gathered per call through nn.Module's attribute lookups, ~40 a layer, they took ~1 ms
        of a 6 ms batch-1 step), and the attention, whose fp8 cache scales may come later."""
        attn, mlp, cfg = self.self_attn, self.mlp, self.config
        if isinstance(mlp, FusedMoE):  # the experts' packed weights in gate_up's and down's place
            gate_up, down, router = mlp.gate_up_proj, mlp.down_proj, mlp.router.weight
            moe = (router, mlp.top_k, mlp.renormalize)
        else:
            gate_up, down, moe = mlp.gate_up_proj.weight, mlp.down_proj.weight, (None, 0, False)
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        weights = (self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                   attn.o_proj.weight, self.post_attention_layernorm.weight, gate_up, down)
        sizes = (attn.num_q_heads, attn.num_kv_heads, mlp.intermediate_size,
                 self.input_layernorm.eps, cfg.sm_scale, attn.sliding_window)
        return weights, sizes, (*norms, *moe), attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output [T, H]; residual: the stream before it (None in the
        first layer, whose x is the embedding) → this layer's (output, residual stream)."""
        if self.fused:
            return self._fused(x, residual, cos, sin, kv_cache, meta)
        if self.config.norm_layout != "pre":  # the sublayers' outputs are normalised
            sandwich = self.config.norm_layout == "sandwich"  # their inputs too (Gemma)
            stream = x if residual is None else x + residual
            h = self.input_layernorm(stream) if sandwich else stream
            stream = stream + self._scaled(self.post_attention_layernorm(
                self.self_attn(h, cos, sin, kv_cache, meta)))
            h = self.pre_feedforward_layernorm(stream) if sandwich else stream
            return self._scaled(self.post_feedforward_layernorm(self.mlp(h))), stream
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self._scaled(self.self_attn(x, cos, sin, kv_cache, meta))
        x, residual = self.post_attention_layernorm(x, residual)
        return self._scaled(self.mlp(x)), residual

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward as one `pagedjax::decoder_layer` call (`fuse`); an fp8 cache's scales are
        read each call (set after the layers fuse)."""
        weights, sizes, rest, attn = self._op_arguments
        return torch.ops.pagedjax.decoder_layer(
            x, residual, *weights, *kv_cache, cos, sin, meta.slot_mapping, meta.kv_lens,
            meta.block_tables, meta.query_start_loc, *sizes, meta.max_query_len, self.qtypes,
            attn.k_scale, attn.v_scale, *rest)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as the residual stream adds it (Granite scales it)."""
        multiplier = self.config.residual_multiplier
        return x if multiplier == 1.0 else x * multiplier


class FusedStack:
    """Fused decoder layers run in one `pagedjax::decoder_layers` call: each layer as its
    `pagedjax::decoder_layer` (the same bits), without ~20 us of argument parsing per layer per
    step. Made where every layer fused and rotates by the one rope table (not Gemma 3's local
    layers); used while they stay fused (expert_load.py unfuses them to hook their modules)."""

    def __init__(self, layers: list[DecoderLayer], weights: list[torch.Tensor | None],
                 sizes: list[int], eps: float, sm_scale: float) -> None:
        self.layers, self.weights, self.sizes = layers, weights, sizes
        self.eps, self.sm_scale = eps, sm_scale
        self.attentions = [layer.self_attn for layer in layers]

    @classmethod
    def of(cls, layers: list[DecoderLayer]) -> FusedStack | None:
        """The op's per-layer arguments (its kLayerWeights weights and kLayerSizes sizes each),
        or None where some layer did not fuse or the layers differ in eps or sm_scale."""
        if not all(layer.fused and not layer.local_rope for layer in layers):
            return None
        weights, sizes, scalars = [], [], set()
        for layer in layers:
            layer_weights, layer_sizes, rest, _ = layer._op_arguments
            num_q_heads, num_kv_heads, intermediate, eps, sm_scale, window = layer_sizes
            q_norm, k_norm, router, top_k, renormalize = rest
            weights += [*layer_weights, q_norm, k_norm, router]
            sizes += [num_q_heads, num_kv_heads, intermediate, window or 0,
                      *(layer.qtypes or (0, 0, 0, 0)), top_k, int(renormalize)]
            scalars.add((eps, sm_scale))
        if len(scalars) != 1:
            return None
        (eps, sm_scale), = scalars
        return cls(layers, weights, sizes, eps, sm_scale)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embedding [T, H] → the last layer's (output, residual stream)."""
        return torch.ops.pagedjax.decoder_layers(
            x, self.weights, *self.caches(kv_caches), cos, sin, meta.slot_mapping, meta.kv_lens,
            meta.block_tables, meta.query_start_loc, self.sizes, self.eps, self.sm_scale,
            self.kv_scales())

    @staticmethod
    def caches(kv_caches: list[KVCache]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The op's k_caches and v_caches: a layer each."""
        return [k for k, _ in kv_caches], [v for _, v in kv_caches]

    def kv_scales(self) -> list[float]:
        """Each layer's (k_scale, v_scale), read each call (set after the layers fuse)."""
        return [s for attn in self.attentions for s in (attn.k_scale, attn.v_scale)]


class LlamaForCausalLM(nn.Module):
    """Returns logits only for the rows in logits_indices (the positions that get sampled)."""

    def __init__(self, config: ModelConfig, ops: LayerOps, shard: Shard) -> None:
        super().__init__()
        self.config, self.shard = config, shard
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(config, ops, shard, i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        start, end = shard.vocab_range(config.vocab_size)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, end - start))
        self.stack: FusedStack | None = None  # every layer in one C++ call (fuse_layers)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids [T], logits_indices [L] → logits [L, V] float32; kv_caches written."""
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        cos = meta.rope_cos.index_select(0, meta.positions)  # [T, D]
        sin = meta.rope_sin.index_select(0, meta.positions)  # [T, D]
        local = (cos, sin)
        if self.config.local_rope_theta is not None:  # the local table follows the global one
            positions = meta.positions + meta.rope_cos.shape[0] // 2
            local = (meta.rope_cos.index_select(0, positions),
                     meta.rope_sin.index_select(0, positions))
        if self.stack is not None and all(layer.fused for layer in self.stack.layers):
            x, residual = self.stack(x, cos, sin, kv_caches, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, *(local if layer.local_rope else (cos, sin)),
                                    kv_cache, meta)
        x, _ = self.norm(x.index_select(0, logits_indices),
                         residual.index_select(0, logits_indices))  # [L, H]
        if self.lm_head is None:  # tied: the embedding is [V, H]
            logits = F.linear(x, self.embed_tokens.weight)  # [L, V / shards]
        else:
            logits = self.lm_head(x)  # [L, V / shards]
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        logits = self.shard.all_gather_vocab(logits, self.config.vocab_size).to(torch.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def greedy_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      kv_caches: list[KVCache], rope: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """J single-token steps, each feeding its logits' argmax to the next, in one C++ op
        (`pagedjax::greedy_decode`: this forward, logits_stats' argmax and the token's logprob,
        op for op, the same bits): input_ids [S] int32 (step 0's tokens), positions [J, S]
        int32, slot_mapping [J, S] (-1: no write), block_tables [S, M] → (tokens [J, S] int32,
        their logprobs [J, S]); kv_caches written. None where the op does not compute this
        model: no fused stack, or a head, multiplier, soft cap or norm it does not have."""
        if not self._greedy_decode_fused():
            return None
        head = self.lm_head
        return torch.ops.pagedjax.greedy_decode(
            input_ids, positions, slot_mapping, block_tables, self.embed_tokens.weight, *rope,
            self.stack.weights, *self.stack.caches(kv_caches), self.stack.sizes, self.stack.eps,
            self.stack.sm_scale, self.stack.kv_scales(), self.norm.weight, head.weight,
            head.qtype, self.config.vocab_size)

    def _greedy_decode_fused(self) -> bool:
        """Whether `pagedjax::greedy_decode` computes this model's forward: every layer in the
        fused stack on one device, a bias-free head packed or in blocks, and nothing between
        them that the op leaves out."""
        cfg, head = self.config, self.lm_head
        return (self.stack is not None and all(layer.fused for layer in self.stack.layers)
                and head is not None and (head.packed or head.qtype is not None)
                and head.bias is None and cfg.embedding_multiplier == 1.0
                and cfg.logits_scaling == 1.0 and cfg.final_logit_softcapping is None
                and self.norm.offset == 0.0 and not self.embed_tokens.split)

    def set_kv_cache_scales(self, scales: list[tuple[float, float]]) -> None:
        """Each layer's (k_scale, v_scale) of an fp8 KV cache (kv_cache_scales.py)."""
        for layer, (k_scale, v_scale) in zip(self.layers, scales, strict=True):
            layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale

    def untie_lm_head(self) -> Linear:
        """The LM head as a Linear of its own (a tied one: over the embedding's [H, V] view)."""
        if self.lm_head is None:
            with torch.device("meta"):
                self.lm_head = Linear(*self.embed_tokens.weight.T.shape)
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.T, requires_grad=False)
        return self.lm_head

    def keep_quantized(self, quantizer: WeightQuantizer) -> None:
        """Each projection and the LM head (a tied one: a copy of the embedding) as the blocks
        `quantizer` keeps for it (backends/common/weight_quantizer.py), or packed float32 where
        it keeps none; then each decoder layer one C++ op (where fusable)."""
        for i, layer in enumerate(self.layers):
            for name, module in (("qkv_proj", layer.self_attn.qkv_proj),
                                 ("o_proj", layer.self_attn.o_proj),
                                 ("gate_up_proj", layer.mlp.gate_up_proj),
                                 ("down_proj", layer.mlp.down_proj)):
                module.keep_quantized(quantizer, projection_label(i, name))
        self.untie_lm_head().keep_quantized(quantizer, LM_HEAD)
        quantizer.summary()
        self.fuse_layers()

    def keep_fp8(self, pack_rest: bool) -> None:
        """quantization="fp8": each projection as float8 with per-channel scales where its sizes
        allow (Linear.keep_fp8); the LM head, and the rest, in the model's dtype (packed for
        the CPU's float32 linear where pack_rest). Layers stay modules (no fused C++ layer)."""
        for layer in self.layers:
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if not module.keep_fp8() and pack_rest:
                    module.pack()
        if pack_rest:
            if self.lm_head is None:
                self.lm_head = Linear.packed_from(self.embed_tokens.weight.T)
            else:
                self.lm_head.pack()

    def fuse_layers(self) -> None:
        """On one device each decoder layer runs as one C++ op (DecoderLayer.fuse), where the
        ops are built (ops_backend() loads them) and the layer is one the op computes
        (ModelConfig.fusable_decoder_layer)."""
        if (self.shard.size == 1 and self.config.fusable_decoder_layer
                and ops_backend() != "reference"):
            for layer in self.layers:
                layer.fuse()
            self.stack = FusedStack.of(list(self.layers))

    def pack_linears(self) -> None:
        """CPU float32: every projection (and the LM head, tied or not) on the packed
        `pagedjax::linear` op, and each mixture of experts' experts on `pagedjax::moe_experts`
        (FusedMoE.pack). A tied head gets its own packed copy of the embedding. On one device
        each decoder layer then runs as one C++ op."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.pack()
        if self.lm_head is None:
            self.lm_head = Linear.packed_from(self.embed_tokens.weight.T)
        self.fuse_layers()
