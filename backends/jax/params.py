"""Canonical HF weights → the Flax parameter tree (linear kernels transposed to [in, out])."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from pagedjax.backends.weights import load_weights

from pagedjax.config import ModelConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def load_params(model_dir: str, config: ModelConfig, dtype: jnp.dtype) -> dict:
    """{"params": ...} for LlamaForCausalLM.apply, in `dtype`, on the default device."""
    w = load_weights(model_dir, config)

    def arr(name: str, transpose: bool = False) -> jnp.ndarray:
        a = np.asarray(w[name])
        return jnp.asarray(a.T if transpose else a, dtype=dtype)

    def dense(prefix: str) -> dict:
        out = {"kernel": arr(f"{prefix}.weight", transpose=True)}
        if f"{prefix}.bias" in w:
            out["bias"] = arr(f"{prefix}.bias")
        return out

    params: dict = {"embed_tokens": {"embedding": arr("embed_tokens")},
                    "norm": {"weight": arr("norm")}}
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": arr("lm_head", transpose=True)}
    for i in range(config.num_layers):
        p = f"layers.{i}"
        params[f"layers_{i}"] = {
            "input_layernorm": {"weight": arr(f"{p}.input_layernorm")},
            "post_attention_layernorm": {"weight": arr(f"{p}.post_attention_layernorm")},
            "self_attn": {name: dense(f"{p}.{name}") for name in _ATTN},
            "mlp": {name: dense(f"{p}.{name}") for name in _MLP},
        }
    return {"params": params}
