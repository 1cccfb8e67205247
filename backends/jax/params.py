"""Canonical HF weights → the Flax parameter tree (linear kernels transposed to [in, out]),
and its Orbax checkpoint: converted once with `pagedjax convert`, restored directly after."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pagedjax.backends.jax.sharding import param_specs, shardings
from pagedjax.backends.weights import layer_norm_names, load_weights, repeat_kv_heads
from pagedjax.config import ModelConfig
from pagedjax.parallel import TensorParallelPlan

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_QK_NORMS = ("q_norm", "k_norm")  # inside self_attn


def orbax_dir(model_dir: str, dtype: jnp.dtype) -> Path:
    """Where `pagedjax convert` stores the converted parameters of a checkpoint."""
    return Path(model_dir) / f"orbax-{jnp.dtype(dtype).name}"


def load_params(model_dir: str, config: ModelConfig, dtype: jnp.dtype, *,
                plan: TensorParallelPlan | None = None,
                mesh: Mesh | None = None) -> tuple[dict, str]:
    """({"params": ...} for LlamaForCausalLM.apply in `dtype`, "orbax" | "safetensors").

    With a mesh, each device receives only its shard (from the host arrays, or straight from
    the Orbax checkpoint); KV heads are repeated plan.kv_replicas times (see pagedjax.parallel).
    """
    plan = plan or TensorParallelPlan(1)
    path = orbax_dir(model_dir, dtype)
    if (path / "_CHECKPOINT_METADATA").is_file():
        return _restore_orbax(path, model_dir, config, dtype, plan, mesh), "orbax"
    params = convert_weights(model_dir, config, dtype, kv_replicas=plan.kv_replicas)
    if mesh is None:
        return jax.device_put(params), "safetensors"
    return jax.device_put(params, shardings(mesh, param_specs(params, plan))), "safetensors"


def _restore_orbax(path: Path, model_dir: str, config: ModelConfig, dtype: jnp.dtype,
                   plan: TensorParallelPlan, mesh: Mesh | None) -> dict:
    """The saved (unrepeated) parameters, each restored into its sharding; k/v repeated after."""
    import orbax.checkpoint as ocp

    abstract = jax.eval_shape(lambda: convert_weights(model_dir, config, dtype, lazy=True))
    if mesh is not None:
        saved_plan = dataclasses.replace(plan, kv_replicas=1)
        specs = param_specs(abstract, saved_plan)
        if plan.kv_replicas > 1:  # the saved k/v do not split by device: restore them whole
            specs = jax.tree_util.tree_map_with_path(
                lambda p, s: P() if _is_kv(p) else s, specs, is_leaf=lambda x: isinstance(x, P))
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
            shardings(mesh, specs))
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(path.resolve(), abstract)
    if plan.kv_replicas == 1:
        return params
    out = shardings(mesh, param_specs(params, plan))
    repeat = jax.jit(functools.partial(_repeat_kv_tree, replicas=plan.kv_replicas,
                                       head_dim=config.head_dim), out_shardings=out)
    return repeat(params)


def _is_kv(path: tuple) -> bool:
    keys = [str(getattr(k, "key", k)) for k in path]
    return any(k in ("k_proj", "v_proj") for k in keys)


def _repeat_kv_tree(params: dict, *, replicas: int, head_dim: int) -> dict:
    """k/v kernels [H, Hkv * D] and biases [Hkv * D]: each head repeated (on the last axis)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a: repeat_kv_heads(a, replicas, head_dim, axis=-1) if _is_kv(p) else a,
        params)


def save_orbax(model_dir: str, config: ModelConfig, dtype: jnp.dtype) -> Path:
    """Convert the safetensors weights once and save them as an Orbax checkpoint."""
    import orbax.checkpoint as ocp

    path = orbax_dir(model_dir, dtype).resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, jax.device_put(convert_weights(model_dir, config, dtype)),
                          force=True)
    return path


def convert_weights(model_dir: str, config: ModelConfig, dtype: jnp.dtype, *,
                    lazy: bool = False, kv_replicas: int = 1) -> dict:
    """The parameter tree from the HF safetensors as host arrays in `dtype` (lazy: device
    zeros of the right shapes, for eval_shape); kv_replicas repeats each KV head."""
    w = load_weights(model_dir, config)

    def arr(name: str, transpose: bool = False):
        a = w[name]
        if lazy:
            return jnp.zeros(a.shape[::-1] if transpose else a.shape, dtype)
        a = np.asarray(a)
        return np.ascontiguousarray(a.T if transpose else a, dtype=jnp.dtype(dtype))

    def dense(prefix: str) -> dict:
        out = {"kernel": arr(f"{prefix}.weight", transpose=True)}
        if f"{prefix}.bias" in w:
            out["bias"] = arr(f"{prefix}.bias")
        if kv_replicas > 1 and prefix.endswith(("k_proj", "v_proj")):
            out = {k: repeat_kv_heads(a, kv_replicas, config.head_dim, axis=-1)
                   for k, a in out.items()}
        return out

    params: dict = {"embed_tokens": {"embedding": arr("embed_tokens")},
                    "norm": {"weight": arr("norm")}}
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": arr("lm_head", transpose=True)}
    norms = layer_norm_names(config)
    for i in range(config.num_layers):
        p = f"layers.{i}"
        attention = {name: dense(f"{p}.{name}") for name in _ATTN}
        attention.update({n: {"weight": arr(f"{p}.{n}")} for n in norms if n in _QK_NORMS})
        params[f"layers_{i}"] = {
            **{n: {"weight": arr(f"{p}.{n}")} for n in norms if n not in _QK_NORMS},
            "self_attn": attention,
            "mlp": {name: dense(f"{p}.{name}") for name in _MLP},
        }
    return {"params": params}
