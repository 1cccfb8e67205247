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

    Sequences are padded to the token bucket T (a decode batch has S <= T): padding sequences
    have no queries (query_start_loc repeats its last value) and kv_len 0; padding tokens have
    slot -1, so replaying on a zeroed batch writes and reads nothing.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32
    query_start_loc: torch.Tensor  # [T+1] int32
    kv_lens: torch.Tensor  # [T] int32
    block_tables: torch.Tensor  # [T, M] int32

    @classmethod
    def empty(cls, num_tokens: int, max_blocks: int, device: torch.device) -> StaticBatch:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
        return cls(zeros(num_tokens), zeros(num_tokens), slot_mapping, zeros(num_tokens + 1),
                   zeros(num_tokens), zeros(num_tokens, max_blocks))

    def fill(self, model_input: ModelInput, upload: HostToDevice) -> None:
        """Copy a decode batch in (non_blocking), padding its S sequences to T."""
        num_tokens = len(self.input_ids)
        for name in ("input_ids", "positions", "slot_mapping"):
            upload(name, getattr(model_input, name), out=getattr(self, name))
        qsl = model_input.query_start_loc
        upload("query_start_loc", _pad(qsl, num_tokens + 1, qsl[-1]), out=self.query_start_loc)
        upload("kv_lens", _pad(model_input.kv_lens, num_tokens, 0), out=self.kv_lens)
        upload("block_tables", _pad(model_input.block_tables, num_tokens, 0),
               out=self.block_tables)


def _pad(array: np.ndarray, length: int, fill: int) -> np.ndarray:
    """array [n, ...] → [length, ...], new rows set to fill."""
    out = np.full((length, *array.shape[1:]), fill, dtype=array.dtype)
    out[: len(array)] = array
    return out


# (StaticBatch, row indices [T]) -> logits [T, V] float32; the model forward on fixed buffers.
GraphForward = Callable[[StaticBatch, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Model forwards of decode batches (one new token per sequence) replayed from CUDA graphs,
    captured lazily, one per token bucket T. A graph computes logits for all T rows (a decode
    row is a sequence's last token); the sampled rows are picked after the replay, so forks
    (more samples than sequences) need no graph of their own. Sampling stays eager.
    """

    def __init__(self, forward: GraphForward, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # graphs share one memory pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StaticBatch, torch.Tensor]] = {}

    @staticmethod
    def applies(model_input: ModelInput) -> bool:
        return model_input.num_tokens == model_input.num_seqs

    def run(self, model_input: ModelInput, upload: HostToDevice) -> torch.Tensor:
        """Logits [T, V] float32 of every token row (a view of the graph's output buffer)."""
        num_tokens = len(model_input.input_ids)
        if num_tokens not in self.graphs:
            self.graphs[num_tokens] = self._capture(num_tokens)
        graph, batch, logits = self.graphs[num_tokens]
        batch.fill(model_input, upload)
        graph.replay()
        return logits

    def _capture(self, num_tokens: int) -> tuple[torch.cuda.CUDAGraph, StaticBatch, torch.Tensor]:
        batch = StaticBatch.empty(num_tokens, self.max_blocks_per_seq, self.device)
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
