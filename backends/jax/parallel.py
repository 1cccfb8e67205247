"""Tensor parallelism for the JAX backend: XLA SPMD over a 1-D device mesh ("tp").

Weights and KV caches carry NamedShardings from one table of rules (parameter path → partition
spec); the jitted step then runs SPMD and XLA inserts the all-reduces after the row-parallel
layers. Attention and the KV write run per shard under `shard_map` (each device attends with its
own heads; a Pallas kernel cannot be partitioned by XLA).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax.distributed.tensor_parallel import COLUMN, LINEAR_SPLITS, TensorParallelPlan

AXIS = "tp"


EXPERT_COLUMNS = P(None, None, AXIS)  # a mixture of experts' gate / up [E, H, I]
EXPERT_ROWS = P(None, AXIS, None)  # its down [E, I, H]


def _rules() -> tuple[tuple[str, P], ...]:
    """Parameter path (".../self_attn/q_proj/kernel") → partition spec, from LINEAR_SPLITS. Flax
    kernels are [in, out]: column-parallel layers split `out` (and their bias), row-parallel
    layers split `in`."""
    rules = []
    for name, split in LINEAR_SPLITS.items():
        rules.append((rf"{name}/kernel$", P(None, AXIS) if split == COLUMN else P(AXIS, None)))
        if split == COLUMN:
            rules.append((rf"{name}/bias$", P(AXIS)))
    # a mixture of experts' experts, [E, in, out] (the router stays whole)
    rules += [(r"mlp/(gate|up)_proj$", EXPERT_COLUMNS), (r"mlp/down_proj$", EXPERT_ROWS)]
    return tuple(rules)


RULES = _rules()  # first match wins
HEADS = P(None, AXIS, None)  # [T, H, D]: split by head
KV_CACHE = P(None, AXIS, None, None)  # [num_blocks, Hkv, block_size, D]
REPLICATED = P()


def make_mesh(size: int) -> Mesh | None:
    """A mesh of the first `size` devices (None for one device)."""
    devices = jax.devices()
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size={size} exceeds the {len(devices)} "
                         f"{devices[0].platform} device(s) present; use at most {len(devices)}.")
    return None if size == 1 else Mesh(np.array(devices[:size]), (AXIS,))


def param_specs(params: dict, plan: TensorParallelPlan) -> dict:
    """The partition spec of every parameter (replicated where no rule applies)."""
    def spec(path: tuple, _leaf) -> P:
        name = "/".join(str(getattr(key, "key", key)) for key in path)
        if not plan.shard_heads or (name.endswith("lm_head/kernel") and not plan.split_vocab):
            return REPLICATED
        return next((s for pattern, s in RULES if re.search(pattern, name)), REPLICATED)

    return jax.tree_util.tree_map_with_path(spec, params)


def shardings(mesh: Mesh, specs) -> object:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def per_shard(attention_fn: Callable, write_kv_fn: Callable, mesh: Mesh | None,
              plan: TensorParallelPlan) -> tuple[Callable, Callable]:
    """The attention and KV-write functions run on each device's heads (unchanged on one
    device or for a replicated model)."""
    if mesh is None or not plan.shard_heads:
        return attention_fn, write_kv_fn

    def attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, **static):
        fn = functools.partial(attention_fn, **static)
        return jax.shard_map(fn, mesh=mesh, check_vma=False,
                             in_specs=(HEADS, KV_CACHE, KV_CACHE, REPLICATED, REPLICATED,
                                       REPLICATED), out_specs=HEADS,
                             )(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)

    def write_kv(k, v, k_cache, v_cache, slot_mapping, **scales):
        fn = functools.partial(write_kv_fn, **scales)  # an fp8 cache's k_scale, v_scale
        return jax.shard_map(fn, mesh=mesh, check_vma=False,
                             in_specs=(HEADS, HEADS, KV_CACHE, KV_CACHE, REPLICATED),
                             out_specs=(KV_CACHE, KV_CACHE),
                             )(k, v, k_cache, v_cache, slot_mapping)

    return attention, write_kv


def per_shard_decode(decode_fn: Callable | None, mesh: Mesh | None,
                     plan: TensorParallelPlan) -> Callable | None:
    """A decode step's fused KV write and attention (decode_attention.py) run on each device's
    heads (unchanged on one device, for a replicated model, or None)."""
    if decode_fn is None or mesh is None or not plan.shard_heads:
        return decode_fn

    def decode(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc,
               **static):
        fn = functools.partial(decode_fn, **static)
        return jax.shard_map(fn, mesh=mesh, check_vma=False,
                             in_specs=(HEADS, HEADS, HEADS, KV_CACHE, KV_CACHE, REPLICATED,
                                       REPLICATED, REPLICATED, REPLICATED),
                             out_specs=(HEADS, KV_CACHE, KV_CACHE),
                             )(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables,
                               query_start_loc)

    return decode


def per_shard_experts(experts_fn: Callable, mesh: Mesh | None,
                      plan: TensorParallelPlan) -> Callable:
    """A mixture of experts' routed_experts run on each device's share of every expert's
    intermediate columns, its partial sums all-reduced once they are combined per token ([T, H],
    as after a dense MLP's down_proj; XLA's own partitioning reduces the [T * k, H] pairs
    before combining them, k times the bytes)."""
    if mesh is None or not plan.shard_heads:
        return experts_fn

    def experts(x, weights, ids, gate_proj, up_proj, down_proj, **static):
        def local(*args):
            return jax.lax.psum(experts_fn(*args, **static), AXIS)

        return jax.shard_map(local, mesh=mesh, check_vma=False,
                             in_specs=(REPLICATED, REPLICATED, REPLICATED, EXPERT_COLUMNS,
                                       EXPERT_COLUMNS, EXPERT_ROWS), out_specs=REPLICATED,
                             )(x, weights, ids, gate_proj, up_proj, down_proj)

    return experts


_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def all_reduce_operands(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every operand all-reduced in compiled HLO text (XLA may combine
    several into one tuple all-reduce, whose type then spans `/*index=N*/` comments)."""
    operands = []
    for line in hlo_text.splitlines():
        result_type, found, _ = line.partition(" all-reduce(")
        if not found or " = " not in result_type:
            continue
        for dtype, dims in _SHAPE.findall(result_type.split(" = ", 1)[1]):
            operands.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return operands
