"""Canonical HF weights → the Flax parameter tree (linear kernels transposed to [in, out]),
and its Orbax checkpoint: converted once with `pagedjax convert`, restored directly after."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.backends.weights import load_weights
from pagedjax.config import ModelConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def orbax_dir(model_dir: str, dtype: jnp.dtype) -> Path:
    """Where `pagedjax convert` stores the converted parameters of a checkpoint."""
    return Path(model_dir) / f"orbax-{jnp.dtype(dtype).name}"


def load_params(model_dir: str, config: ModelConfig, dtype: jnp.dtype) -> tuple[dict, str]:
    """({"params": ...} for LlamaForCausalLM.apply in `dtype`, "orbax" | "safetensors")."""
    path = orbax_dir(model_dir, dtype)
    if (path / "_CHECKPOINT_METADATA").is_file():
        import orbax.checkpoint as ocp

        abstract = jax.eval_shape(lambda: convert_weights(model_dir, config, dtype, lazy=True))
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path.resolve(), abstract), "orbax"
    return convert_weights(model_dir, config, dtype), "safetensors"


def save_orbax(model_dir: str, config: ModelConfig, dtype: jnp.dtype) -> Path:
    """Convert the safetensors weights once and save them as an Orbax checkpoint."""
    import orbax.checkpoint as ocp

    path = orbax_dir(model_dir, dtype).resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, convert_weights(model_dir, config, dtype), force=True)
    return path


def convert_weights(model_dir: str, config: ModelConfig, dtype: jnp.dtype, *,
                    lazy: bool = False) -> dict:
    """The parameter tree from the HF safetensors (lazy: shapes only, for eval_shape)."""
    w = load_weights(model_dir, config)

    def arr(name: str, transpose: bool = False) -> jax.Array:
        a = w[name]
        if lazy:
            shape = a.shape[::-1] if transpose else a.shape
            return jnp.zeros(shape, dtype)
        a = np.asarray(a)
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
