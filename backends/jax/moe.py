"""A mixture of experts' MLP on the JAX backend (Qwen3-MoE, Mixtral, OLMoE, Granite-MoE): the
semantics of backends/torch/moe.py.

The router scores every expert; each token goes to its top k, weighted by the softmax (over all
experts, renormalised over the k where the architecture says: `moe_routing`). The experts run
as two `jax.lax.ragged_dot`s over the step's T * k (token, expert) pairs sorted by expert
(static shapes: the group sizes are data), and each pair's output, times its weight, is added
back into its token's row.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.config import ModelConfig


def moe_routing(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] → (weights [T, k] float32, experts [T, k] int32): the softmax over
    all experts (float32), its top k, divided by their sum where renormalize."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


class FusedMoE(nn.Module):
    """params: router {"kernel" [H, E]}, gate_up_proj [E, H, 2I] (each expert's gate columns,
    then its up columns), down_proj [E, I, H]."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, H] → [T, H]."""
        from pagedjax.backends.jax.model import Dense, matmul_precision

        cfg = self.config
        e, inter, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        precision = matmul_precision(self.dtype)
        gate_up_proj = self.param("gate_up_proj", nn.initializers.zeros,
                                  (e, cfg.hidden_size, 2 * inter), self.dtype)
        down_proj = self.param("down_proj", nn.initializers.zeros,
                               (e, inter, cfg.hidden_size), self.dtype)
        x = x.astype(self.dtype)
        weights, experts = moe_routing(Dense(e, self.dtype, name="router")(x), k,
                                       cfg.renormalize_topk)  # [T, k]
        flat = experts.reshape(-1)  # [T * k]: pair p is token p // k's choice p % k
        order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
        tokens = order // k
        group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E]
        gate_up = jax.lax.ragged_dot(x[tokens], gate_up_proj, group_sizes,
                                     precision=precision)  # [T * k, 2I]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = nn.silu(gate) if cfg.hidden_act == "silu" else nn.gelu(gate, approximate=True)
        y = jax.lax.ragged_dot(act * up, down_proj, group_sizes, precision=precision)  # [T*k, H]
        y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros_like(x).at[tokens].add(y)
