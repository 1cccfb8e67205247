"""A mixture of experts' MLP on the JAX backend (Qwen3-MoE, Mixtral, OLMoE, Granite-MoE): the
semantics of backends/torch/moe.py.

The router scores every expert; each token goes to its top k, weighted by the softmax (over all
experts, renormalised over the k where the architecture says: `moe_routing`). The experts run as
`jax.lax.ragged_dot`s over the step's T * k (token, expert) pairs sorted by expert (static shapes:
the group sizes are data), and each pair's output, times its weight, is added back into its token's
row. Gate and up are two weights, not one fused [E, H, 2I]: under tensor parallelism each splits by
column (each device holds its share of every expert's intermediate dimension,
backends/jax/parallel.py) and XLA partitions the products, with one all-reduce after down_proj, as
for a dense MLP. Packed (CPU, float32, one device: `pack_params`), the experts run as one C++ call
instead, `cpu_ffi.moe_experts`: each chosen expert's products on the packed linear's blocks, where
ragged_dot computed every expert densely on the CPU (benchmarks/moe.py's decode step from 24x its
dense twin's time to 0.9-1.1x).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.backends.jax.linear import dense, matmul_precision
from pagedjax.config import ModelConfig


def moe_routing(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] → (weights [T, k] float32, experts [T, k] int32): the softmax over
    all experts (float32), its top k, divided by their sum where renormalize."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


ExpertsFn = Callable[..., jax.Array]  # routed_experts, or its per-device form under TP


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                   up_proj: jax.Array, down_proj: jax.Array, *, hidden_act: str,
                   form: str | None = None) -> jax.Array:
    """x [T, H], weights and experts [T, k] (moe_routing's), gate_proj and up_proj [E, H, I],
    down_proj [E, I, H] → [T, H]: each token's sum over its k experts of weight * expert(x).

    Two forms (EXPERT_FORMS), chosen by the step's static shape unless `form` names one: with
    at most E / 4 (token, expert) pairs (small decode steps), "gathered": the chosen experts'
    weights gathered and multiplied per pair (reads T * k experts); otherwise "grouped": the
    pairs sorted by expert and run as ragged_dots (reads all E, but streams them 3-4x faster
    than the per-pair gathers read theirs on a GPU: RESULTS.md's expert block tables)."""
    form = form or ("gathered" if 4 * experts.size <= gate_proj.shape[0] else "grouped")
    act = nn.silu if hidden_act == "silu" else functools.partial(nn.gelu, approximate=True)
    return EXPERT_FORMS[form](x, weights, experts, gate_proj, up_proj, down_proj, act)


def _gathered(x, weights, experts, gate_proj, up_proj, down_proj, act) -> jax.Array:
    precision = matmul_precision(x.dtype)
    gate, up = (jnp.einsum("th,tkhi->tki", x, w[experts], precision=precision)
                for w in (gate_proj, up_proj))  # [T, k, I] each
    y = jnp.einsum("tki,tkih->tkh", act(gate) * up, down_proj[experts],
                   precision=precision)  # [T, k, H]
    return jnp.einsum("tkh,tk->th", y, weights.astype(y.dtype))


def _grouped(x, weights, experts, gate_proj, up_proj, down_proj, act) -> jax.Array:
    precision = matmul_precision(x.dtype)
    flat = experts.reshape(-1)  # [T * k]: pair p is token p // k's choice p % k
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    tokens = order // experts.shape[1]
    group_sizes = jnp.bincount(flat, length=gate_proj.shape[0]).astype(jnp.int32)  # [E]
    rows = x[tokens]  # [T * k, H]
    gate, up = (jax.lax.ragged_dot(rows, w, group_sizes, precision=precision)
                for w in (gate_proj, up_proj))  # [T * k, I] each
    y = jax.lax.ragged_dot(act(gate) * up, down_proj, group_sizes,
                           precision=precision)  # [T * k, H]
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[tokens].add(y)


EXPERT_FORMS: dict[str, Callable[..., jax.Array]] = {"gathered": _gathered, "grouped": _grouped}


class FusedMoE(nn.Module):
    """params: router {"kernel" [H, E]}, gate_proj and up_proj [E, H, I], down_proj [E, I, H];
    packed (pack_params), the router's kernel [ceil(E / 16), H, 16] (PackedLinear's),
    gate_up_packed [E, ceil(2I / 16), H, 16] and down_packed [E, ceil(H / 16), I, 16]
    (cpu_ffi.pack_moe_weights). experts_fn: routed_experts, or under tensor parallelism its
    per-device form (backends/jax/parallel.py's per_shard_experts)."""

    config: ModelConfig
    dtype: jnp.dtype
    packed: bool = False
    experts_fn: ExpertsFn = routed_experts

    @nn.compact
    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """x [T, H] → [T, H]. num_rows (int32 scalar, packed only): the rows after it are
        padding, left at zero instead of waking the experts their routes name."""
        cfg = self.config
        e, inter, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        x = x.astype(self.dtype)
        # packed: the router too (PackedLinear; XLA's dot of a decode step's [1, H] x [H, E]
        # took ~60 us longer than the C++ linear's)
        logits = dense(e, "router", self.dtype, packed=self.packed)(x)  # [T, E]
        weights, experts = moe_routing(logits, k, cfg.renormalize_topk)  # [T, k]
        if self.packed:
            return self._packed_experts(x, weights, experts, num_rows)
        gate_proj, up_proj = (self.param(name, nn.initializers.zeros,
                                         (e, cfg.hidden_size, inter), self.dtype)
                              for name in ("gate_proj", "up_proj"))
        down_proj = self.param("down_proj", nn.initializers.zeros,
                               (e, inter, cfg.hidden_size), self.dtype)
        return self.experts_fn(x, weights, experts, gate_proj, up_proj, down_proj,
                               hidden_act=cfg.hidden_act)

    def _packed_experts(self, x: jax.Array, weights: jax.Array, experts: jax.Array,
                        num_rows: jax.Array | None) -> jax.Array:
        """The experts as one cpu_ffi.moe_experts call over the packed params: x [T, H],
        weights and experts [T, k] → [T, H]."""
        from pagedjax.backends.jax import cpu_ffi

        cfg = self.config
        e, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        # the C++ block has SiLU only: every mixture-of-experts architecture's activation
        assert cfg.hidden_act == "silu", cfg.hidden_act
        tile = cpu_ffi.LINEAR_TILE
        w13 = self.param("gate_up_packed", nn.initializers.zeros,
                         (e, -(-2 * inter // tile), hidden, tile), self.dtype)
        w2 = self.param("down_packed", nn.initializers.zeros,
                        (e, -(-hidden // tile), inter, tile), self.dtype)
        return cpu_ffi.moe_experts(x, experts, weights, w13, w2, inter, num_rows)
