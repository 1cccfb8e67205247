"""A rank > 0 of a tensor-parallel torch runner: `python -m pagedjax.backends.torch.worker`,
started by `parallel.Workers` with its runner's arguments pickled on stdin."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys

import torch.distributed as dist

from pagedjax.backends.torch.parallel import broadcast, device_of, init_process_group

_PR_SET_PDEATHSIG = 1  # Linux prctl: a signal for this process when its parent dies


def _worker_main(runner_args: tuple, rank: int, size: int, port: int) -> None:
    """A rank > 0: build this rank's runner, then run what rank 0 broadcasts until shutdown."""
    if os.uname().sysname == "Linux":  # die with the engine's process, however it ends
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    from pagedjax.backends.torch.runner import TorchModelRunner  # after: it loads for seconds

    init_process_group(rank, size, port, device_of(rank))
    runner = TorchModelRunner(*runner_args, rank=rank)
    try:
        while True:
            kind, payload = broadcast(None)
            if kind == "shutdown":
                break
            getattr(runner, kind)(payload)  # "execute_local" or "allocate_kv_caches"
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker_main(*pickle.load(sys.stdin.buffer))
