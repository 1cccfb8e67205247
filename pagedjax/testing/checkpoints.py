"""Build small Hugging Face checkpoints locally (no model hub): a byte-level BPE tokenizer
trained on the Python standard library's source, and randomly initialised Llama-family models
saved with transformers' save_pretrained. Tests, the run command and benchmarks use them."""

from __future__ import annotations

import sysconfig
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
# Multi-byte text so the tokenizer learns merges that split characters across tokens.
MULTIBYTE_TEXT = "naïve café — ünïcödé 日本語のテキスト 中文 한국어 😀🎉 ∑∫√ " * 20
_CORPUS_FILES = ("textwrap.py", "json/encoder.py", "heapq.py", "bisect.py", "shlex.py")

TINY_ARCH_DEFAULTS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    # A wide init makes logits decisive, so greedy argmaxes are not near-ties.
    initializer_range=0.2,
)


def stdlib_corpus(files: tuple[str, ...] = _CORPUS_FILES) -> list[str]:
    """Source files of this Python's standard library (present on every install)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text(encoding="utf-8") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE PreTrainedTokenizerFast with one special token, EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


# name -> (transformers config class, model class, overrides its tiny config needs)
TINY_ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"layer_types": None}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"layer_types": None, "head_dim": 24}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # multipliers away from 1, so that each one matters
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
        "logits_scaling": 2.0}),
    # LongRoPE: 8 short and long factors (head_dim 16), pretrained on 128 of 512 positions
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "original_max_position_embeddings": 128, "rope_scaling": {
            "rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}}),
    # Gemma scales embeddings by sqrt(hidden): a narrow init keeps greedy output varied. The
    # attention cap is low enough to change the greedy tokens (a test checks it does).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 1, "sliding_window": 24,
        "attn_logit_softcapping": 0.3, "final_logit_softcapping": 10.0,
        "initializer_range": 0.02}),
    # a sliding and a global layer, each with its own rope base; a softmax scale of its own
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"], "initializer_range": 0.02}),
    # Mixtures of experts: 8 experts, top 2; router weights scaled (ROUTER_SCALE) so that the
    # top-k margins stand well above float32 noise. Qwen3-MoE: its first layer dense.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "layer_types": None, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
        "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
        "logits_scaling": 2.0}),
}
ROUTER_SCALE = 4.0  # the mixtures of experts' router weights, times this after the random init


def make_tiny_checkpoint(out_dir: str | Path, architecture: str = "llama", *, seed: int = 0,
                         tokenizer=None, **overrides) -> Path:
    """Save a random `architecture` (a TINY_ARCHITECTURES name) model + tokenizer."""
    import torch
    import transformers

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}; use one of {tuple(TINY_ARCHITECTURES)}.")
    tokenizer = tokenizer or train_tokenizer(stdlib_corpus() + [MULTIBYTE_TEXT])
    config_name, model_name, arch_overrides = TINY_ARCHITECTURES[architecture]
    kwargs = dict(TINY_ARCH_DEFAULTS, vocab_size=len(tokenizer),
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id, **arch_overrides)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                              "block_sparse_moe.router.weight", "router.layer.weight")):
                param.mul_(ROUTER_SCALE)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
