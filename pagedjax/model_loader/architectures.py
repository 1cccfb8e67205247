"""The architectures pagedjax serves, as data: one row per Hugging Face class.

Both backends hold one decoder definition (Llama's) whose variations are switched by the fields
of `ModelConfig`; a row says which variation an architecture uses and how its checkpoint names
its weights. A mixture of experts is a variation too: its layers' MLP is a router and experts.
Adding a Llama-like family is a row here, a `make_tiny_checkpoint` entry and a greedy-parity
test (tests/e2e/test_hf_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The variations a decoder layer can take (ModelConfig fields of the same names).
QK_NORMS = (None, "head", "full")  # RMSNorm on q and k before rope: per head, or whole projection
# "pre": norms before attention and MLP (Llama); "post": on their outputs (OLMo 2);
# "sandwich": both (Gemma)
NORM_LAYOUTS = ("pre", "post", "sandwich")
HIDDEN_ACTS = ("silu", "gelu_tanh")  # the gated MLP's activation


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture departs from Llama."""

    model_type: str  # config.json's model_type
    qk_norm: str | None = None
    norm_layout: str = "pre"
    attention_bias: bool = False  # the default when config.json does not say
    # config.json flag that must be true for its sliding_window to apply (Qwen's
    # use_sliding_window); None: sliding_window applies as given
    window_flag: str | None = None
    # checkpoint tensor (suffix of model.layers.{i}.) → the canonical tensors it splits into,
    # in order, along its output rows (Phi-3's fused projections)
    fused_weights: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # config.json keys read as multipliers (Granite); absent keys mean 1 (or head_dim**-0.5)
    multipliers: bool = False
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma's 1 + w
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # config.json's layer_types give each layer its window ("sliding_attention") or none, its
    # softmax scale is query_pre_attn_scalar ** -0.5, sliding layers may have their own rope
    # base, and attn_logit_softcapping / final_logit_softcapping cap scores and logits (Gemma)
    gemma_attention: bool = False
    # A mixture of experts replaces the MLP (in every layer, or as config.json's
    # decoder_sparse_step / mlp_only_layers say): the router's softmax over all experts, its
    # top k, renormalised to sum to 1 where renormalize_topk says (None: config.json's
    # norm_topk_prob, default False). Top-k of the logits then a softmax over the k (Mixtral,
    # Granite-MoE) is the same as renormalising.
    experts: bool = False
    renormalize_topk: bool | None = None

    def __post_init__(self) -> None:  # a mistyped row fails at import, not in a model
        assert self.qk_norm in QK_NORMS, self.qk_norm
        assert self.norm_layout in NORM_LAYOUTS, self.norm_layout
        assert self.hidden_act in HIDDEN_ACTS, self.hidden_act


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama"),
    "MistralForCausalLM": Architecture("mistral"),
    "Qwen2ForCausalLM": Architecture("qwen2", attention_bias=True,
                                     window_flag="use_sliding_window"),
    "Qwen3ForCausalLM": Architecture("qwen3", qk_norm="head", window_flag="use_sliding_window"),
    "Olmo2ForCausalLM": Architecture("olmo2", qk_norm="full", norm_layout="post"),
    "GraniteForCausalLM": Architecture("granite", multipliers=True),
    "Gemma2ForCausalLM": Architecture("gemma2", norm_layout="sandwich", hidden_act="gelu_tanh",
                                      norm_weight_offset=1.0, scaled_embeddings=True,
                                      gemma_attention=True),
    "Gemma3ForCausalLM": Architecture("gemma3_text", qk_norm="head", norm_layout="sandwich",
                                      hidden_act="gelu_tanh", norm_weight_offset=1.0,
                                      scaled_embeddings=True, gemma_attention=True),
    "Phi3ForCausalLM": Architecture("phi3", fused_weights={
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "mlp.gate_up_proj": ("gate_proj", "up_proj")}),
    # mixtures of experts
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", qk_norm="head",
                                        window_flag="use_sliding_window", experts=True),
    "MixtralForCausalLM": Architecture("mixtral", experts=True, renormalize_topk=True),
    "OlmoeForCausalLM": Architecture("olmoe", qk_norm="full", experts=True),
    "GraniteMoeForCausalLM": Architecture("granitemoe", multipliers=True, experts=True,
                                          renormalize_topk=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ARCHITECTURE_BY_MODEL_TYPE = {a.model_type: name for name, a in ARCHITECTURES.items()}


def architecture(name: str) -> Architecture:
    """The row of an HF architecture name, or a ValueError listing those served."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported; pagedjax serves "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    return ARCHITECTURES[name]
