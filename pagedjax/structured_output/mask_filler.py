"""MaskFiller: fills token-mask rows on a thread of its own, through one llguidance call per
batch, while the engine thread goes on with Python work.

Why one call: llguidance drops the GIL while it fills, but a Python thread needs the GIL back
between calls, and a thread that asks for it while the engine thread runs Python waits out the
interpreter's switch interval (5 ms) each time (200 calls beside a busy Python thread: 1071 ms
against 8 ms alone). LLExecutor.unsafe_compute_mask_ptr fills every row of a batch in one call,
so the filler takes the GIL once to start; `submit` hands it over (the engine thread waits until
the fill has let it go) and the engine thread takes it straight back. The end needs it once
more: the engine thread gives it up when it waits for the rows (`FillJob.wait`).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class FillJob:
    """Rows being filled: `mask` [len(rows), W] int32, row i for matcher rows[i][0]."""

    rows: list[tuple[Any, int]]
    mask: np.ndarray
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self) -> np.ndarray | None:
        """The filled rows, or None if the fill failed (the caller fills them itself)."""
        self.done.wait()
        return None if self.error is not None else self.mask


class MaskFiller:
    def __init__(self, executor: Any) -> None:
        self.executor = executor  # llguidance.LLExecutor
        self._jobs: queue.SimpleQueue[FillJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagedjax-mask-fill", daemon=True)
        self._thread.start()

    def submit(self, matchers: list[Any], width: int) -> FillJob:
        """Start filling one mask row per matcher ([len(matchers), width] int32). The matchers
        belong to the filler until the job is done: nothing else may call them meanwhile."""
        job = FillJob([(m, i) for i, m in enumerate(matchers)],
                      np.empty((len(matchers), width), np.int32))
        self._jobs.put(job)
        job.started.wait()  # the GIL goes to the filler until llguidance lets it go
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            pointer, num_rows = job.mask.ctypes.data, job.mask.shape[0]
            row_bytes = job.mask.strides[0]
            job.started.set()
            try:
                self.executor.unsafe_compute_mask_ptr(job.rows, pointer, row_bytes, num_rows)
            except BaseException as error:  # noqa: BLE001 - handed to the engine thread
                job.error = error
            finally:
                job.done.set()

    def shutdown(self) -> None:
        self._jobs.put(None)
