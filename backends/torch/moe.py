"""A mixture of experts' MLP on the torch backend (Qwen3-MoE, Mixtral, OLMoE, Granite-MoE).

The router scores every expert; each token goes to its top k, weighted by the softmax (over all
experts, renormalised over the k where the architecture says: `moe_routing`). The experts then run
as two grouped matrix products over the step's T * k (token, expert) pairs sorted by expert
(`torch.nn.functional.grouped_mm`: each expert's weights read once per step, an expert no token
chose skipped, no shape that depends on the routing), and each pair's output, times its weight, is
added back into its token's row. With fewer pairs than experts (a decode step) the chosen experts'
weights are gathered and multiplied per pair instead (`routed_experts`' forms). On the CPU in
float32 (`pack`, as the dense projections are packed) the experts run as one C++ op instead,
`pagedjax::moe_experts`: each chosen expert's products on the packed linear's blocks
(kernels_cuda/csrc/cpu/kernels/moe_experts_kernel.h): benchmarks/moe.py's decode step from 2.4x its
dense twin's time to 1.2x. There the routing is a C++ op too (`pagedjax::moe_routing`), the one the
fused decoder layer runs (model.py's DecoderLayer.fuse: router, routing and experts inside the
layer's one call), so the two paths give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedjax.backends.torch.parallel import Shard
from pagedjax.config import ModelConfig
from pagedjax.kernels_cuda import moe_experts, moe_routing, pack_moe_weights, silu_and_mul


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               loop: bool = False) -> torch.Tensor:
    """x [M, K] (rows sorted by group) @ w [G, K, N] per group → [M, N]; offsets [G] int32: the
    end row of each group. torch's grouped GEMM where its 16-byte alignment holds (and not
    `loop`), else a loop over the groups (which reads the offsets on the host)."""
    aligned = all(n * x.element_size() % 16 == 0 for n in (w.shape[1], w.shape[2]))
    if aligned and x.dtype in (torch.float32, torch.bfloat16) and not loop:
        return F.grouped_mm(x, w, offs=offsets)
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


class FusedMoE(nn.Module):
    """router [H, E] (a Linear), experts' gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    (the checkpoint's layout, read transposed; under tensor parallelism I is this rank's share,
    and the output is all-reduced); once packed, gate_up_proj [E, ceil(2I / 16), H,
    16] and down_proj [E, ceil(H / 16), I, 16] (pack_moe_weights)."""

    def __init__(self, config: ModelConfig, shard: Shard, router: nn.Module) -> None:
        """router: x [T, H] → logits [T, E] (the model's Linear, packed with its others)."""
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        inter = shard.part(config.moe_intermediate_size)  # this rank's share of each expert
        self.shard, self.top_k, self.renormalize = shard, config.num_experts_per_tok, (
            config.renormalize_topk)
        self.hidden_act = config.hidden_act
        self.intermediate_size = inter
        self.router = router
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))
        self.packed = False  # the experts run as pagedjax::moe_experts (`pack`)

    def pack(self) -> None:
        """CPU float32: the experts' weights packed for `pagedjax::moe_experts` (its kernel has
        SiLU only: another activation keeps grouped_mm). The router is a Linear, packed with
        the model's others."""
        if self.hidden_act != "silu":
            return
        w13, w2 = pack_moe_weights(self.gate_up_proj.detach(), self.down_proj.detach())
        self.gate_up_proj = nn.Parameter(w13, requires_grad=False)
        self.down_proj = nn.Parameter(w2, requires_grad=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → [T, H]."""
        weights, experts = moe_routing(self.router(x), self.top_k, self.renormalize)  # [T, k]
        if self.packed:
            return self.shard.all_reduce(moe_experts(
                x, experts, weights, self.gate_up_proj, self.down_proj, self.intermediate_size))
        return self.shard.all_reduce(routed_experts(x, weights, experts, self.gate_up_proj,
                                                    self.down_proj, self.hidden_act))


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor, hidden_act: str,
                   form: str | None = None) -> torch.Tensor:
    """x [T, H], weights and experts [T, k] (moe_routing's), gate_up_proj [E, 2I, H], down_proj
    [E, H, I] → [T, H]: each token's sum over its k experts of weight * expert(x).

    The forms (EXPERT_FORMS), chosen by the number of (token, expert) pairs unless `form` names
    one: no more pairs than experts (a decode step), "gathered": each pair's expert weights
    gathered and multiplied as a batch (reads T * k experts, where grouped_mm may read every
    one); otherwise "grouped": two grouped products over the pairs sorted by expert; "loop":
    the grouped form with a product per expert (grouped_mm's fallback, for comparison)."""
    form = form or ("gathered" if experts.numel() <= gate_up_proj.shape[0] else "grouped")
    return EXPERT_FORMS[form](x, weights, experts, gate_up_proj, down_proj, hidden_act)


def _gathered(x, weights, experts, gate_up_proj, down_proj, hidden_act) -> torch.Tensor:
    t, k = weights.shape
    flat = experts.flatten()  # [T * k]: pair p is token p // k's choice p % k
    rows = x.repeat_interleave(k, dim=0)[:, :, None]  # [T * k, H, 1]
    gate_up = torch.bmm(gate_up_proj[flat], rows).squeeze(-1)  # [T * k, 2I]
    h = _act(gate_up, hidden_act)[:, :, None]  # [T * k, I, 1]
    y = torch.bmm(down_proj[flat], h).view(t, k, -1)  # [T, k, H]
    return (y * weights[:, :, None].to(y.dtype)).sum(dim=1)


def _grouped(x, weights, experts, gate_up_proj, down_proj, hidden_act,
             loop: bool = False) -> torch.Tensor:
    flat = experts.flatten()  # [T * k]: pair p is token p // k's choice p % k
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    tokens = order // experts.shape[1]
    offsets = torch.bincount(flat, minlength=gate_up_proj.shape[0]).cumsum(0).to(
        torch.int32)  # [E] each expert's end row
    gate_up = grouped_mm(x.index_select(0, tokens), gate_up_proj.transpose(1, 2), offsets,
                         loop)  # [T * k, 2I]
    y = grouped_mm(_act(gate_up, hidden_act), down_proj.transpose(1, 2), offsets,
                   loop)  # [T * k, H]
    y = y * weights.flatten().index_select(0, order)[:, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


def _act(gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """[N, 2I] → [N, I]: act(gate) * up."""
    if hidden_act == "silu":
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # gelu_tanh
    return F.gelu(gate, approximate="tanh") * up


EXPERT_FORMS: dict[str, Callable[..., torch.Tensor]] = {
    "gathered": _gathered, "grouped": _grouped,
    "loop": functools.partial(_grouped, loop=True)}
