"""Host→device uploads (pinned buffers on CUDA) and CUDA graphs of whole steps.

UNVERIFIED on a GPU: written without one at hand. CPU runs only use HostToDevice's CPU branch
(which shares the NumPy arrays' memory); StepGraphs and the pinned path are CUDA-only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import numpy as np
import torch

from pagedjax.cache import compile_at_startup

logger = logging.getLogger(__name__)


class HostToDevice:
    """NumPy → device tensors. On CUDA through pinned staging buffers (one per name, grown on
    demand) and non_blocking copies; on CPU the array's memory is shared.

    Steps take two sets of staging buffers in turn (begin_step, end_step): the next step is
    launched before the last one is waited for (async scheduling), so its uploads must not
    overwrite buffers whose copies may still be queued. A set is reused two steps later, after
    the event of the step that last filled it (at most one step is in flight: done by then).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sets: tuple[dict[str, torch.Tensor], ...] = ({}, {})
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._current = 0
        self._staging = self._sets[0]

    def begin_step(self) -> None:
        """Take the other set of staging buffers, once its last step's copies are done."""
        self._current ^= 1
        self._staging = self._sets[self._current]
        done = self._done[self._current]
        if done is not None:
            done.synchronize()

    def end_step(self, done: torch.cuda.Event | None) -> None:
        """done: an event recorded after this step's uploads (None on CPU)."""
        self._done[self._current] = done

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


# (ints [I] int32, floats [F] float32) on the device -> the step's output tensors
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, ...]]


class StepGraphs:
    """Whole steps (draft loop, target pass, sampling) replayed from CUDA graphs, one per key
    (the step's BatchLayout and sampler variant), all captured before the first request
    (`capture`). A graph reads the packed inputs from two fixed device buffers, refilled before
    each replay; its outputs are views of the graph's own buffers, valid until the next replay.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # graphs share one memory pool
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor,
                                          tuple[torch.Tensor | None, ...]]] = {}
        self.num_late_captures = 0  # graphs captured while serving: each one a logged bug
        self._late_captures_expected = not compile_at_startup()  # unless startup captured none

    def capture(self, key: Hashable, step: StepFn, ints: np.ndarray, floats: np.ndarray,
                upload: HostToDevice) -> None:
        """Capture the graph of one key (on inputs that write no KV, such as padding)."""
        self.graphs[key] = self._capture(step, ints, floats, upload)

    def run(self, key: Hashable, step: StepFn, ints: np.ndarray, floats: np.ndarray,
            upload: HostToDevice) -> tuple[torch.Tensor | None, ...]:
        if key not in self.graphs:
            self.num_late_captures += 1
            if self._late_captures_expected:
                logger.info("capturing a CUDA graph on first use (%s)", key)
            else:
                logger.warning("capturing a CUDA graph after startup (%s): the closed set of "
                               "step_shapes.py missed it", key)
            self.graphs[key] = self._capture(step, ints, floats, upload)
        graph, ints_buffer, floats_buffer, outputs = self.graphs[key]
        upload("ints", ints, out=ints_buffer)
        upload("floats", floats, out=floats_buffer)
        graph.replay()
        return outputs

    def _capture(self, step: StepFn, ints: np.ndarray, floats: np.ndarray,
                 upload: HostToDevice) -> tuple:
        # Captured on this step's real inputs: the warm-up run writes exactly what the step
        # would (KV of its own slots), so it is harmless; the replay that follows repeats it.
        ints_buffer, floats_buffer = upload("ints", ints), upload("floats", floats)
        # One eager run on a side stream first: lazy initialisation (cuBLAS handles and
        # workspaces) must not happen inside the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(ints_buffer, floats_buffer)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls other threads make meanwhile (a JAX engine's runtime in the
        # same process, an output thread) neither invalidate the capture nor fail themselves,
        # as under the default "global" mode (seen on an H200: both engines' streams broken).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = step(ints_buffer, floats_buffer)
        return graph, ints_buffer, floats_buffer, outputs
