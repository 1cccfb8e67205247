"""Host→device uploads (pinned buffers on CUDA) and CUDA graphs of decode forwards.

UNVERIFIED on a GPU: written without one at hand. CPU runs only use HostToDevice's CPU branch
(which shares the NumPy arrays' memory); DecodeGraphs and the pinned path are CUDA-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedjax.batch import ModelInput


class HostToDevice:
    """NumPy → device tensors. On CUDA through pinned staging buffers (one per field, grown on
    demand, reused every step) and non_blocking copies; on CPU the array's memory is shared.

    Reusing a staging buffer is safe: every step ends by synchronising on its sampled tokens, so
    the previous step's copies out of the buffer have completed before it is overwritten.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, array: np.ndarray,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """`array` on the device, in a new tensor or copied into `out` (same shape)."""
        src = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return src if out is None else out.copy_(src)
        staged = self._stage(name, src)
        if out is None:
            return staged.to(self.device, non_blocking=True)
        return out.copy_(staged, non_blocking=True)

    def _stage(self, name: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._staging.get(name)
        if buf is None or buf.dtype != src.dtype or buf.numel() < src.numel():
            buf = self._staging[name] = torch.empty(src.numel(), dtype=src.dtype,
                                                    pin_memory=True)
        return buf[: src.numel()].view(src.shape).copy_(src)


@dataclass
class StaticBatch:
    """A decode graph's input buffers: fixed addresses, refilled before every replay.

    Zero-filled with slot -1 everywhere, it is all padding: a capture run writes and reads nothing.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    kv_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, M] int32

    @classmethod
    def empty(cls, num_tokens: int, num_seqs: int, max_blocks: int,
              device: torch.device) -> StaticBatch:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
        return cls(zeros(num_tokens), zeros(num_tokens), slot_mapping, zeros(num_seqs + 1),
                   zeros(num_seqs), zeros(num_seqs, max_blocks))

    def fill(self, model_input: ModelInput, upload: HostToDevice) -> None:
        """Copy a batch of the same padded shapes in (non_blocking)."""
        for name, buffer in vars(self).items():
            upload(name, getattr(model_input, name), out=buffer)


# (StaticBatch, row indices [T]) -> logits [T, V] float32; the model forward on fixed buffers.
GraphForward = Callable[[StaticBatch, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Model forwards of decode batches (one new token per sequence) replayed from CUDA graphs,
    captured lazily, one per padded shape (T, S). Keying on S too (rather than padding sequences
    up to T) keeps the attention grid and its split-K choice those of the eager launch.

    A graph computes logits for all T rows (a decode row is a sequence's last token); the sampled
    rows are picked after the replay, so forks (more samples than sequences) need no graph of
    their own. Sampling stays eager.
    """

    def __init__(self, forward: GraphForward, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # graphs share one memory pool
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StaticBatch,
                                                  torch.Tensor]] = {}

    @staticmethod
    def applies(model_input: ModelInput) -> bool:
        return model_input.num_tokens == model_input.num_seqs

    def run(self, model_input: ModelInput, upload: HostToDevice) -> torch.Tensor:
        """Logits [T, V] float32 of every token row (a view of the graph's output buffer)."""
        shape = (len(model_input.input_ids), len(model_input.kv_lens))  # padded (T, S)
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(*shape)
        graph, batch, logits = self.graphs[shape]
        batch.fill(model_input, upload)
        graph.replay()
        return logits

    def _capture(self, num_tokens: int,
                 num_seqs: int) -> tuple[torch.cuda.CUDAGraph, StaticBatch, torch.Tensor]:
        batch = StaticBatch.empty(num_tokens, num_seqs, self.max_blocks_per_seq, self.device)
        rows = torch.arange(num_tokens, dtype=torch.int32, device=self.device)
        # One eager run on a side stream first: lazy initialisation (cuBLAS handles and
        # workspaces) must not happen inside the capture. The batch is all padding: a no-op.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(batch, rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(batch, rows)  # [T, V]
        return graph, batch, logits
