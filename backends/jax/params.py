"""Loading and layout: canonical HF weights → the Flax parameter tree (linear kernels transposed
to [in, out]), and its Orbax checkpoint: converted once with `pagedjax convert`, restored
directly after. DeviceModel: one model on the device(s), as a runner holds it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax.backends.common import quantization
from pagedjax.backends.common.kv_cache_scales import kv_cache_scales
from pagedjax.backends.common.rope import rope_cos_sin
from pagedjax.backends.common.weight_quantizer import WeightQuantizer
from pagedjax.backends.common.weights import layer_norm_names, load_weights, repeat_kv_heads
from pagedjax.backends.jax.attention import (
    PALLAS_IMPLS,
    resolve_attention,
    uses_cpu_linear,
)
from pagedjax.backends.jax.model import KVCache, LlamaForCausalLM, pack_params
from pagedjax.backends.jax.moe import routed_experts
from pagedjax.backends.jax.parallel import (
    KV_CACHE,
    REPLICATED,
    param_specs,
    per_shard,
    per_shard_decode,
    per_shard_experts,
    shardings,
)
from pagedjax.backends.jax.stacked_params import ParamStacks, stack_layers
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.distributed.tensor_parallel import TensorParallelPlan

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
    the Orbax checkpoint); KV heads are repeated plan.kv_replicas times (see
    pagedjax.distributed.tensor_parallel).
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

    def arr_experts(name: str, rows: slice = slice(None)):  # [E, out, in] → [E, in, out]
        a = w[name]
        if lazy:
            out = len(range(a.shape[1])[rows])
            return jnp.zeros((a.shape[0], a.shape[2], out), dtype)
        return np.ascontiguousarray(np.asarray(a)[:, rows].transpose(0, 2, 1),
                                    dtype=jnp.dtype(dtype))

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
        if config.is_moe_layer(i):  # gate and up apart: each splits by column under TP
            inter, gate_up = config.moe_intermediate_size, f"{p}.experts.gate_up_proj"
            mlp = {"router": dense(f"{p}.router"),
                   "gate_proj": arr_experts(gate_up, slice(0, inter)),  # [E, H, I]
                   "up_proj": arr_experts(gate_up, slice(inter, 2 * inter)),  # [E, H, I]
                   "down_proj": arr_experts(f"{p}.experts.down_proj")}  # [E, I, H]
        else:
            mlp = {name: dense(f"{p}.{name}") for name in _MLP}
        params[f"layers_{i}"] = {
            **{n: {"weight": arr(f"{p}.{n}")} for n in norms if n not in _QK_NORMS},
            "self_attn": attention,
            "mlp": mlp,
        }
    return {"params": params}


def fp8_params(params: dict) -> dict:
    """quantization="fp8": each projection's kernel [in, out] as float8 e4m3 [out, in] in rows
    with a float32 "weight_scale" [out] per output channel (quantization.quantize_fp8; the
    model's Dense then multiplies fp8 by fp8: linear.fp8_dot), where in and out are multiples of
    16 (cuBLASLt's FP8 GEMM); the embedding, norms and LM head as they are. [out, in] in rows is
    the layout cuBLASLt's FP8 GEMM reads (both operands contract their minor dimension, "TN"):
    kept [in, out], XLA would transpose every weight in every step."""
    def fp8(layer: dict) -> dict:
        kernel = np.asarray(layer["kernel"]).astype(np.float32)  # [in, out]
        if kernel.shape[0] % 16 or kernel.shape[1] % 16:
            return layer
        q, scale = quantization.quantize_fp8(kernel.T)  # [out, in], [out]
        return {**layer, "kernel": jnp.asarray(np.ascontiguousarray(q)),
                "weight_scale": jnp.asarray(scale)}

    tree = dict(params["params"])
    for name, layer in tree.items():
        if name.startswith("layers_"):
            tree[name] = {**layer, **{block: {n: fp8(p) if n in projections else p
                                              for n, p in layer[block].items()}
                                      for block, projections in (("self_attn", _ATTN),
                                                                 ("mlp", _MLP))}}
    return {**params, "params": tree}


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """One model on the device(s): module, params, rope tables and how it is split."""

    module: LlamaForCausalLM
    params: dict | list[jax.Array]  # the tree, or its arrays with the layers stacked (stacks)
    rope: tuple[jax.Array, jax.Array]  # cos, sin: [max_model_len, D]
    config: ModelConfig  # as the devices hold it (KV heads repeated under tensor parallelism)
    plan: TensorParallelPlan
    params_source: str  # "orbax" | "safetensors"
    stacks: ParamStacks | None = None  # how the stacked arrays rebuild the tree

    @classmethod
    def load(cls, model_dir: str, model_config: ModelConfig, config: EngineConfig,
             plan: TensorParallelPlan, mesh: Mesh | None) -> DeviceModel:
        dtype = jnp.dtype(config.dtype)
        attention = resolve_attention(config.attention_impl)
        impl = attention.name
        shard_config = plan.shard_config(model_config)
        fp8 = config.quantization == "fp8"  # XLA's dots over float8 weights (not packed)
        packed = not fp8 and uses_cpu_linear(impl, dtype, mesh)
        scales = None  # an fp8 KV cache's per layer (k_scale, v_scale)
        if config.fp8_kv_cache:
            check_fp8_pallas(impl)
            scales = tuple(kv_cache_scales(model_dir, model_config.num_layers))
        decode_fn = attention.decode_fn
        if decode_fn is not None:
            from pagedjax.kernels_pallas.decode_attention import supports

            if not supports(shard_config.num_q_heads, shard_config.num_kv_heads,
                            shard_config.head_dim):
                decode_fn = None  # a head_dim the fused kernel does not take
        module = LlamaForCausalLM(
            shard_config, dtype, *per_shard(attention.attention_fn, attention.write_kv_fn, mesh,
                                            plan), packed, scales,
            per_shard_experts(routed_experts, mesh, plan),
            per_shard_decode(decode_fn, mesh, plan))
        params, source = load_params(model_dir, model_config, dtype, plan=plan, mesh=mesh)
        if config.quantization in ("int8", "gguf") and not packed:
            raise ValueError(f"quantization={config.quantization!r} runs on the C++ CPU kernels "
                             f"(float32, attention_impl 'cpu' or 'auto' on a CPU, one device), "
                             f"not with attention_impl={impl!r}, dtype={config.dtype!r} on "
                             f"{jax.default_backend()}; use quantization=None there.")
        if fp8:
            params = fp8_params(params)
        elif packed:
            quantizer = None
            if config.quantization is not None:
                quantizer = WeightQuantizer(config.quantization, shard_config, config.gguf_path)
            params = pack_params(params, model_config.tie_word_embeddings, quantizer)
        stacks = None
        if stacks_layer_params(packed, mesh):
            stacks, params = stack_layers(params)
        cos, sin = rope_cos_sin(model_config, config.max_model_len)
        return cls(module, params, (jnp.asarray(cos), jnp.asarray(sin)), shard_config, plan,
                   source, stacks)

    def tree(self, params: dict | list[jax.Array]) -> dict:
        """The parameter tree of what the step takes (self.params' form)."""
        return params if self.stacks is None else self.stacks.unstack(params)

    def hidden(self, params: dict | list[jax.Array]) -> functools.partial:
        """(input_ids [T], kv_caches, meta) -> (hidden states [T, H], kv_caches)."""
        return functools.partial(self.module.apply, self.tree(params))

    def logits(self, params: dict | list[jax.Array]) -> Callable[..., jax.Array]:
        """(hidden states [R, H], num_rows=None) -> float32 logits [R, V] (Model.logits)."""
        return functools.partial(self.module.apply, self.tree(params),
                                 method=LlamaForCausalLM.logits)

    def forward(self, params: dict | list[jax.Array]) -> Callable:
        """(input_ids, kv_caches, meta, logits_indices [R]) -> (logits [R, V], kv_caches)."""
        def run(input_ids, kv_caches, meta, logits_indices):
            hidden, kv_caches = self.hidden(params)(input_ids, kv_caches, meta)
            return self.logits(params)(hidden[logits_indices]), kv_caches

        return run

    def allocate_kv_caches(self, num_blocks: int, block_size: int,
                           mesh: Mesh | None) -> list[KVCache]:
        """Zeroed caches, each device holding its heads' share."""
        cfg, dtype = self.config, self.module.kv_cache_dtype
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        if mesh is None:
            zeros = lambda: jnp.zeros(shape, dtype)
        else:
            spec = KV_CACHE if self.plan.shard_heads else REPLICATED
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype),
                            out_shardings=NamedSharding(mesh, spec))
        return [(zeros(), zeros()) for _ in range(cfg.num_layers)]

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """KV bytes of one block on each device."""
        shards = self.plan.size if self.plan.shard_heads else 1
        return self.config.kv_bytes_per_block(block_size, dtype_bytes) // shards


def stacks_layer_params(packed: bool, mesh: Mesh | None) -> bool:
    """Whether the step takes the layers' weights stacked (stacked_params.py): where
    PAGEDJAX_STACK_LAYER_PARAMS=1 asks (off by default until a GPU measures it), with unpacked
    weights on one device (C++ calls take whole arrays; no sharding rules for stacks)."""
    from pagedjax import envs

    return envs.PAGEDJAX_STACK_LAYER_PARAMS and not packed and mesh is None


def check_fp8_pallas(impl: str) -> None:
    """Triton converts float8 e4m3 ("fp8e4nv") from sm_89 on (Ada, Hopper): an fp8 KV cache
    with the Pallas kernel on an older GPU is a ValueError, not a compile error per step."""
    capability = getattr(jax.devices()[0], "compute_capability", None)  # "9.0" on GPUs
    if impl in PALLAS_IMPLS and capability and tuple(map(int, capability.split("."))) < (8, 9):
        raise ValueError(f"kv_cache_dtype='fp8' on the jax backend's Pallas kernel needs an "
                         f"sm_89+ GPU (Ada, Hopper), this one is sm_{capability}; use "
                         f"backend='torch' (its CUDA kernel converts fp8 on sm_80) or "
                         f"kv_cache_dtype='auto'.")
