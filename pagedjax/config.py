"""Model and engine configuration. ModelConfig reads an HF checkpoint's config.json itself, so the
core knows shapes (for KV sizing and validation) without importing transformers, jax or torch."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedjax.model_loader.architectures import (
    ARCHITECTURE_BY_MODEL_TYPE,
    SUPPORTED_ARCHITECTURES,
    architecture,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and its architecture's variations of the Llama decoder
    (pagedjax/model_loader/architectures.py), read from config.json (transformers v4 and v5
    layouts)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear" | "llama3", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None
    dtype: str | None = None  # the checkpoint's torch_dtype ("bfloat16", ...), if it names one
    has_remote_code: bool = False  # config.json maps classes to the checkpoint's own code
    # Variations of the decoder (architectures.py); the defaults are Llama's.
    qk_norm: str | None = None  # "head": RMSNorm [D] on each q/k head; "full": on [H * D]
    norm_layout: str = "pre"  # "pre": norm, then attention/MLP; "post": norm on their outputs
    embedding_multiplier: float = 1.0  # embeddings scaled by it (Granite)
    residual_multiplier: float = 1.0  # attention/MLP outputs scaled by it before the residual add
    attention_multiplier: float | None = None  # the softmax scale; None: head_dim ** -0.5
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_tanh"
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight) (Gemma: 1)
    # per layer: its sliding window or None (full attention); None: every layer sliding_window
    layer_sliding_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None  # the sliding layers' own rope base (Gemma 3)
    # scores and logits capped to cap * tanh(x / cap) (Gemma 2); None: uncapped
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (architectures.py): experts per sparse layer (0: a dense model), the
    # k each token is routed to, each expert's MLP width, whether the k weights are
    # renormalised to sum to 1, and which layers are sparse (None: every layer, if any expert)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    renormalize_topk: bool = False
    moe_layers: tuple[bool, ...] | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        if not self.num_experts:
            return False
        return self.moe_layers is None or self.moe_layers[layer]

    @property
    def sm_scale(self) -> float:
        """The scale of q.k before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim**-0.5

    @property
    def fusable_decoder_layer(self) -> bool:
        """What the fused C++ CPU decoder layer computes: Llama's layer, with Qwen3's per-head
        q/k norms and mixture-of-experts MLPs (SiLU) allowed; not OLMo 2's whole-projection
        q/k norms, other norm layouts, multipliers, norm offsets or soft-capping."""
        return (self.qk_norm in (None, "head") and self.norm_layout == "pre"
                and self.hidden_act == "silu" and self.residual_multiplier == 1.0
                and self.norm_weight_offset == 0.0 and self.attn_logit_softcapping is None)

    def sliding_window_of(self, layer: int) -> int | None:
        """The window of one layer's attention (None: it attends to the whole context)."""
        if self.layer_sliding_windows is None:
            return self.sliding_window
        return self.layer_sliding_windows[layer]

    def local_rope(self, layer: int) -> bool:
        """Whether a layer rotates by the local rope table (rope_cos_sin's second half)."""
        return self.local_rope_theta is not None and self.sliding_window_of(layer) is not None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model={str(model_dir)!r} has no config.json: pass a Hugging Face "
                             "checkpoint directory (config.json, *.safetensors, tokenizer files).")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or [
            ARCHITECTURE_BY_MODEL_TYPE.get(cfg.get("model_type"), "?")]
        arch = archs[0]
        row = architecture(arch)
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported; use a checkpoint without MLP biases.")
        if arch == "Qwen3ForCausalLM" and cfg.get("attention_bias"):
            raise ValueError("Qwen3 with attention_bias=True (an o_proj bias) is not supported.")
        num_q_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(cfg)
        window = cfg.get("sliding_window")
        if row.window_flag is not None and not cfg.get(row.window_flag, False):
            window = None
        variations = dict(hidden_act=row.hidden_act, norm_weight_offset=row.norm_weight_offset)
        if row.scaled_embeddings:
            variations["embedding_multiplier"] = float(cfg["hidden_size"]) ** 0.5
        if row.gemma_attention:
            variations.update(_gemma_attention(cfg, window, rope_theta))
        if row.experts:
            variations.update(_experts(cfg, row.renormalize_topk))
        multipliers = {}
        if row.multipliers:
            multipliers = dict(
                embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                attention_multiplier=cfg.get("attention_multiplier"),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_q_heads=num_q_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_q_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_q_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", row.attention_bias)),
            sliding_window=window,
            dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            has_remote_code="auto_map" in cfg,
            qk_norm=row.qk_norm,
            norm_layout=row.norm_layout,
            **variations,
            **multipliers,
        )

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """Bytes one KV block takes across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * block_size * self.head_dim * dtype_bytes


def quantized_experts_error(architecture: str, quantization: str) -> str:
    """The refusal of quantization= for a mixture of experts (said before a GGUF's conversion
    too: pagedjax.engine.core)."""
    return (f"{architecture} (a mixture of experts) runs unquantized for now, not with "
            f"quantization={quantization!r}; use quantization=None.")


def _experts(cfg: dict, renormalize: bool | None) -> dict:
    """A mixture of experts' fields from config.json (Qwen3-MoE, Mixtral, OLMoE, Granite-MoE
    names, transformers v4 and v5)."""
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg.get("num_experts_per_tok")
    if not num_experts or not k or not 1 <= k <= num_experts:
        raise ValueError(f"a mixture of experts needs num_experts >= num_experts_per_tok >= 1; "
                         f"config.json gives num_experts={num_experts!r}, "
                         f"num_experts_per_tok={k!r}.")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={cfg['clip_qkv']!r} is not supported; use a checkpoint "
                         "trained without it (clip_qkv: null).")
    if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
        raise ValueError("shared experts are not supported (Qwen2-MoE, DeepSeek); Qwen3-MoE, "
                         "Mixtral, OLMoE and Granite-MoE are.")
    num_layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return {"num_experts": int(num_experts), "num_experts_per_tok": int(k),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size")
                                         or cfg["intermediate_size"]),
            "renormalize_topk": bool(cfg.get("norm_topk_prob", False)
                                     if renormalize is None else renormalize),
            "moe_layers": None if all(layers) else layers}


def _gemma_attention(cfg: dict, window: int | None, global_theta: float) -> dict:
    """Gemma's per-layer windows (layer_types, or every sliding_window_pattern-th layer global),
    softmax scale, the sliding layers' rope base and the soft-caps."""
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 2)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(num_layers)]
    out: dict = {"layer_sliding_windows": tuple(
        window if t == "sliding_attention" else None for t in types)}
    out["attention_multiplier"] = float(cfg.get("query_pre_attn_scalar", cfg["head_dim"])) ** -0.5
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    local_theta = local["rope_theta"] if local else cfg.get("rope_local_base_freq")
    if local is not None and local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={local['rope_type']!r} on sliding layers is not supported.")
    if local_theta is not None and float(local_theta) != global_theta:
        out["local_rope_theta"] = float(local_theta)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            out[key] = float(cfg[key])
    return out


def _parse_rope(cfg: dict) -> tuple[float, dict | None]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params = dict(params.get("full_attention", params))  # per layer type (Gemma 3): the global
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; use one of "
                         f"{SUPPORTED_ROPE_TYPES}.")
    if float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0) != 1:
        raise ValueError("partial_rotary_factor != 1 is not supported.")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "longrope":
        params.update(_longrope(cfg, params))
    return theta, params


def _longrope(cfg: dict, params: dict) -> dict:
    """LongRoPE (Phi-3) as transformers derives it: the pretraining length, and the cos/sin
    scale from the extension factor (max_position_embeddings over that length)."""
    original = int(params.get("original_max_position_embeddings")
                   or cfg["original_max_position_embeddings"])
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return {"original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}


# What `quantization=` takes (vLLM's option): the kept-quantized weight formats built so far.
QUANTIZATION_METHODS = (None, "int8", "gguf", "fp8")
# What `kv_cache_dtype=` takes (vLLM's option and aliases): "auto" is the model's dtype; the
# others store float8 e4m3 (k / k_scale, saturated to +-448) and attention reads cache * scale.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model itself, under vLLM's names (EngineArgs
    adds the command-line side). Options vLLM has that pagedjax cannot honour yet fail in
    validate() with a ValueError that names them."""

    model: str
    tokenizer: str | None = None  # a tokenizer directory (default: the model's)
    backend: str = "jax"  # pagedjax's own: "jax" | "torch"
    # "auto": the checkpoint's dtype on a GPU, float32 on CPU (where bf16 matmuls are slow and
    # float32 is what HF parity is checked in); or "float32" | "bfloat16" | "float16"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's, at most 4096
    block_size: int = 16
    # Share of the accelerator's memory for weights, activations and the KV pool; on CPU, the
    # share of a fixed 4 GiB KV budget (kv_cache.CPU_KV_CACHE_BYTES).
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None  # the KV pool's size in blocks, not measured
    # The closed set of compiled steps (core/step_shapes.py) grows with these two, each
    # doubling adding a bucket; max_model_len widens every step's block tables.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs (torch); harmless elsewhere
    # The outputs of a step (detokenized text, stop strings, RequestOutputs) are built while the
    # device runs the next one, where the runner launches steps asynchronously (jax); vLLM's
    # async output processing. True: built before step() returns, as the torch runner does.
    disable_async_output_proc: bool = False
    # Schedule and launch each decode step before the last one's tokens reach the host, its
    # input tokens read on the device (vLLM's async scheduling), where the runner launches
    # asynchronously and can (jax, on a GPU or a CPU: it measured faster on both); step()
    # then returns the outputs of the step before the one it launched. Decode steps without
    # penalties, structured outputs, speculation or beams; any other step runs as before.
    async_scheduling: bool = True
    tensor_parallel_size: int = 1
    # {"model": draft_dir, "num_speculative_tokens": k, "method": "draft_model",
    #  "adaptive": True}; the engine replaces it with its validated SpeculativeConfig, which
    # the runners read (spec_decode.py)
    speculative_config: Any = None
    trust_remote_code: bool = False  # accepted; checkpoints with custom code are refused
    attention_impl: str = "auto"  # pagedjax's own; see the backends' resolve_attention
    # Weights kept quantized (vLLM's name): None; "int8" (symmetric per output channel,
    # quantized at load) or "gguf" (a GGUF file's Q8_0/Q4_0/Q4_1 blocks as they are): the
    # projections and the LM head on the CPU kernels (both backends); "fp8" (W8A8, vLLM's
    # dynamic FP8: e4m3 weights per output channel, activations per token; any device, FP8
    # GEMMs on Hopper GPUs).
    quantization: str | None = None
    # The KV cache's storage (vLLM's name): "auto", the model's dtype; "fp8" / "fp8_e4m3",
    # float8 e4m3 with a float32 scale per layer for k and for v (the checkpoint's
    # self_attn.k_scale / v_scale, else 1.0): half the bytes of bf16, twice the blocks.
    kv_cache_dtype: str = "auto"
    # The model's reasoning format (vLLM's --reasoning-parser: "deepseek_r1", "qwen3"): a
    # structured output constrains the answer after the reasoning, not the reasoning itself;
    # the server and LLM.chat split the two with it.
    reasoning_parser: str | None = None
    # Set by the engine: the GGUF file `model` was converted from (None: not a GGUF source)
    gguf_path: str | None = None

    def validate(self, model_config: ModelConfig, default_dtype: str = "float32") -> None:
        """Check user-facing values; fill what depends on the model (max_model_len, dtype).
        Whether tensor_parallel_size splits the model is TensorParallelPlan.for_model's check.

        default_dtype: what "auto" means on the runner's device.
        """
        if self.dtype == "auto":
            self.dtype = default_dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unsupported; use one of "
                             f"{('auto', *DTYPES)}.")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; use one of "
                             f"{QUANTIZATION_METHODS}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one "
                             f"of {KV_CACHE_DTYPES}.")
        q = self.quantization
        if q == "fp8" and self.tensor_parallel_size != 1:
            raise ValueError(f"quantization='fp8' runs on one device, not tensor_parallel_size="
                             f"{self.tensor_parallel_size}; use tensor_parallel_size=1, or "
                             f"quantization=None.")
        if q in ("int8", "gguf") and (self.dtype != "float32" or self.tensor_parallel_size != 1):
            raise ValueError(f"quantization={q!r} runs on the CPU kernels with float32 "
                             f"activations on one device, not with dtype={self.dtype!r} and "
                             f"tensor_parallel_size={self.tensor_parallel_size}; use "
                             f"dtype='float32' (the default on CPU) and one device, or "
                             f"quantization=None.")
        if model_config.num_experts and q is not None:
            raise ValueError(quantized_experts_error(model_config.architecture, q))
        if q == "gguf" and self.gguf_path is None:
            raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks, but model="
                             f"{self.model!r} is no GGUF file; pass a .gguf file, or use "
                             f"quantization='int8' to quantize this checkpoint at load.")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size={self.block_size} is unsupported; use 8, 16 or 32.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                             "(0, 1].")
        if self.trust_remote_code and model_config.has_remote_code:
            raise ValueError(f"model {self.model!r} needs its own code (auto_map), which "
                             f"pagedjax does not run (trust_remote_code=True); supported "
                             f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.")
        if model_config.qk_norm == "full" and self.tensor_parallel_size > 1:
            raise ValueError(f"{model_config.architecture} normalises q and k over all heads, "
                             "which tensor parallelism does not split yet; use "
                             "tensor_parallel_size=1.")
        if self.max_model_len is None:
            self.max_model_len = min(model_config.max_position_embeddings, 4096)
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_config.max_position_embeddings}.")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        blocks = self.num_gpu_blocks_override
        if blocks is not None and blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"num_gpu_blocks_override={blocks} cannot hold one sequence of max_model_len="
                f"{self.max_model_len} ({self.max_blocks_per_seq} blocks of {self.block_size}); "
                "raise num_gpu_blocks_override or lower max_model_len.")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def fp8_kv_cache(self) -> bool:
        """Whether the KV cache stores float8 e4m3 (kv_cache_dtype "fp8" / "fp8_e4m3")."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def kv_cache_dtype_bytes(self) -> int:
        """Bytes of one cached key or value element: 1 in fp8, else the model dtype's."""
        return 1 if self.fp8_kv_cache else self.dtype_bytes
