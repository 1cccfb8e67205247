"""A model's weights as a few arrays at the step call: each weight every decoder layer has
(same name, shape and dtype) stacked along a new leading axis, `[L, ...]`, and the parameter
tree rebuilt inside the traced step by indexing them (issue 50 item 4).

Why: a 1B Llama's step took ~180 weight arrays per call (9 per layer); on an H200 jax's
launch of a decode step was 0.6-1.1 ms of host time (RESULTS.md, stops 76 and 78), 64 more
arguments (FP8's scales) adding ~0.4-0.6 ms. Stacked, the weights are ~12 arguments whatever
the depth. XLA fuses the static index of a stacked weight into its consumer (a GEMM fusion
reads its layer's slice in place); the KV caches stay one array per layer (donated, written in
place by the attention kernels).

Off until a GPU measures it: PAGEDJAX_STACK_LAYER_PARAMS=1 turns it on for unpacked weights on
one device. On a CPU XLA copies each layer's slice before its dot (a tiny Llama's decode step:
31 KB of temporaries unstacked, 303 KB stacked: the weights), so a CPU never wants it; whether a
GPU's GEMM fusions read the slices in place is what `test_stacked_params.py`'s gpu-marked test
and gpu_suite's `decode_step_jax_stacked` answer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

_LAYER = re.compile(r"layers_\d+")


@dataclasses.dataclass(frozen=True, eq=False)
class ParamStacks:
    """How the step's arrays rebuild the parameter tree: array g holds the leaves groups[g]
    (in the tree's leaf order), stacked along axis 0, or the leaf itself for a group of one."""

    treedef: Any  # jax's PyTreeDef of the parameter tree
    groups: tuple[tuple[int, ...], ...]

    def unstack(self, arrays: list[jax.Array]) -> Any:
        """The parameter tree (inside a trace: static slices of the stacked arrays)."""
        leaves: list[Any] = [None] * self.treedef.num_leaves
        for indices, array in zip(self.groups, arrays, strict=True):
            if len(indices) == 1:
                leaves[indices[0]] = array
            else:
                for j, i in enumerate(indices):
                    leaves[i] = array[j]
        return jax.tree.unflatten(self.treedef, leaves)


def _generic(path: tuple) -> tuple[str, ...]:
    """A leaf's path with its layer index dropped: ("params", "layers_*", "mlp", ...)."""
    names = (str(getattr(key, "key", getattr(key, "name", key))) for key in path)
    return tuple("layers_*" if _LAYER.fullmatch(name) else name for name in names)


def stack_layers(params: Any) -> tuple[ParamStacks, list[jax.Array]]:
    """(how to rebuild params, its arrays with the layers' weights stacked). Each stacked
    group's layer arrays are deleted once stacked, so the weights take at most one group more
    memory than before, for the time of one stack."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    buckets: dict[tuple, list[int]] = {}
    for i, (path, leaf) in enumerate(flat):
        buckets.setdefault((_generic(path), leaf.shape, str(leaf.dtype)), []).append(i)
    arrays = []
    for indices in buckets.values():
        leaves = [flat[i][1] for i in indices]
        if len(leaves) == 1:
            arrays.append(leaves[0])
            continue
        arrays.append(jnp.stack(leaves))
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
    return ParamStacks(treedef, tuple(map(tuple, buckets.values()))), arrays
