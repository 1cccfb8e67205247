"""Expert load: how many (token, expert) choices each expert of each mixture-of-experts layer
received while an `LLM` generated, and a heatmap of it.

    >>> with record_expert_load(llm) as load:          # LLM(..., backend="torch"), a MoE
    ...     llm.generate(prompts, params)
    >>> load.counts                                     # [num_moe_layers, num_experts]
    >>> plot_expert_load(load, num_prompts=len(prompts))

A forward hook on each layer's router recounts the top k of its logits (`moe_routing`, the experts
FusedMoE then runs); a decoder layer fused into one C++ op (the CPU's float32 path) runs as its
modules while recording (the same bits), so that the hook is called. Every token the engine computes
is counted once per layer: prompt tokens at prefill, each generated token when it is fed back (the
last one never is), and, with speculative decoding, every verified draft position, accepted or not;
a preempted sequence's recomputed tokens again. Tokens found in the prefix cache are not computed,
so not counted. The padding rows of a step are not counted: the torch runner's eager steps run only
the step's real tokens (StepBody's num_tokens); a CUDA graph replays padded shapes without calling
Python hooks, so it is refused (enforce_eager=True runs every step eagerly).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pagedjax.entrypoints.llm import LLM


@dataclass
class ExpertLoad:
    """(token, expert) choices per expert of each mixture-of-experts layer."""

    model: str  # the checkpoint's folder name
    layers: list[int]  # the decoder layer of each row of counts (dense layers have none)
    top_k: int  # experts each token chooses
    counts: np.ndarray = field(repr=False)  # [num_moe_layers, num_experts] int64

    @property
    def num_tokens(self) -> int:
        """Tokens routed through each layer."""
        return int(self.counts[0].sum()) // self.top_k if len(self.counts) else 0

    def shares(self) -> np.ndarray:
        """[num_moe_layers, num_experts]: each expert's share of its layer's choices (rows sum
        to 1; zeros before any token)."""
        totals = self.counts.sum(axis=1, keepdims=True)
        return self.counts / np.maximum(totals, 1)


def _moe_layers(llm: LLM) -> tuple[list[int], list[Any], Any, list[Any]]:
    """(decoder layer indices, their FusedMoE modules, the model config, the decoder layers) of
    llm's target model, or a ValueError saying why its routing cannot be recorded."""
    from pagedjax.engine.llm_engine import LLMEngine

    engine = getattr(llm, "engine", None)
    if not isinstance(engine, LLMEngine):
        raise ValueError(f"llm.engine={engine!r}: expert load is recorded in the engine core's "
                         "process; make the LLM with multiprocess=False (and not shut down).")
    config, model_config = engine.config, engine.model_config
    if config.backend != "torch":
        raise ValueError(f"backend={config.backend!r}: expert load is recorded on the torch "
                         "backend's modules; make the LLM with backend='torch'.")
    if not model_config.num_experts:
        raise ValueError(f"model={config.model!r} is dense ({model_config.architecture}): it has "
                         "no router; use a mixture of experts (Qwen3MoeForCausalLM, "
                         "MixtralForCausalLM, OlmoeForCausalLM, GraniteMoeForCausalLM).")
    runner = engine.runner
    if getattr(runner, "graphs", None) is not None:
        raise ValueError("enforce_eager=False on CUDA: decode steps replay CUDA graphs, which "
                         "call no Python hooks; make the LLM with enforce_eager=True.")
    from pagedjax.backends.torch.moe import FusedMoE

    module = runner.models[0].module  # the target (a draft's routing is not recorded)
    moe = [(i, layer.mlp) for i, layer in enumerate(module.layers)
           if isinstance(layer.mlp, FusedMoE)]
    return [i for i, _ in moe], [m for _, m in moe], model_config, list(module.layers)


@contextmanager
def record_expert_load(llm: LLM) -> Iterator[ExpertLoad]:
    """Count, per mixture-of-experts layer, the experts every token computed inside the `with`
    block chose (see the module docstring for which tokens). load.counts is filled when the
    block ends. llm: an in-process LLM with backend="torch" (on CUDA, enforce_eager=True)."""
    import torch

    from pagedjax.backends.torch.moe import moe_routing

    layers, modules, model_config, decoder_layers = _moe_layers(llm)
    num_experts = model_config.num_experts
    device = modules[0].gate_up_proj.device
    running = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)

    def hook(row: int, moe: Any):
        def count(_router: Any, _inputs: Any, logits: torch.Tensor) -> None:  # [T, E]
            _, experts = moe_routing(logits, moe.top_k, moe.renormalize)  # [T, k]
            running[row] += torch.bincount(experts.flatten(), minlength=num_experts)
        return count

    handles = [moe.router.register_forward_hook(hook(row, moe))
               for row, moe in enumerate(modules)]
    fused = [layer for layer in decoder_layers if layer.fused]
    for layer in fused:  # its modules' forward, the same bits, calls the hooks
        layer.fused = False
    load = ExpertLoad(Path(llm.engine.config.model).name, layers,
                      model_config.num_experts_per_tok,
                      np.zeros((len(layers), num_experts), dtype=np.int64))
    try:
        yield load
    finally:
        for handle in handles:
            handle.remove()
        for layer in fused:
            layer.fused = True
        load.counts = running.cpu().numpy()


def plot_expert_load(load: ExpertLoad, *, num_prompts: int, ax: Axes | None = None,
                     title: str | None = None, vmax: float | None = None) -> Axes:
    """A heatmap, layers × experts, of each expert's share of its layer's routes, with a
    colorbar (0 to vmax, default the largest share: give heatmaps side by side one vmax);
    titled with the model and the prompt count unless `title` says otherwise. An even load
    is 1 / num_experts everywhere."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 0.35 * load.counts.shape[1],
                                      1.2 + 0.3 * len(load.layers)))
    shares = load.shares()
    image = ax.imshow(shares, cmap="viridis", vmin=0, vmax=vmax, aspect="auto",
                      interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label="share of the layer's routes")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    if shares.shape[1] <= 32:  # a label per expert where they fit
        ax.set_xticks(range(shares.shape[1]))
    ax.set_yticks(range(len(load.layers)), [str(i) for i in load.layers])
    ax.set_title(title if title is not None else
                 f"{load.model}: {num_prompts} prompt{'s' * (num_prompts != 1)}, "
                 f"{load.num_tokens} tokens, "
                 f"top {load.top_k} of {shares.shape[1]}")
    return ax
