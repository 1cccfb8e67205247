"""Tensor parallelism for the torch backend: torch.distributed, one process per rank.

The engine's process is rank 0: it schedules and broadcasts each step's plain-data batch
(`ModelInput`) to ranks 1..N-1, which the runner starts itself (one Python process each). Every rank
holds its shard of the weights and KV caches and runs the same step; the row-parallel layers
all-reduce, the vocabulary-split embedding all-reduces and the LM head all-gathers. gloo on CPU,
NCCL on GPUs (UNVERIFIED: no multi-GPU machine was available).
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedjax.distributed.tensor_parallel import LINEAR_SPLITS, TensorParallelPlan

_WORKER_MODULE = "pagedjax.backends.torch.worker"  # what a rank > 0 runs


@dataclass(frozen=True)
class Shard:
    """Which part of a model this rank holds."""

    rank: int = 0
    plan: TensorParallelPlan = TensorParallelPlan(1)

    @property
    def size(self) -> int:
        return self.plan.size if self.plan.shard_heads else 1

    def part(self, n: int) -> int:
        """This rank's share of n heads / columns."""
        return n // self.size

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary this rank's embedding and LM head hold."""
        if self.size == 1 or not self.plan.split_vocab:
            return 0, vocab_size
        part = vocab_size // self.size
        return self.rank * part, (self.rank + 1) * part

    def cut(self, array, layer: str, n_per_rank: int, stacked: bool = False):
        """This rank's n_per_rank outputs or inputs of a canonical weight [out, in] (or bias
        [out]) of a linear layer, as LINEAR_SPLITS splits it (q_proj, o_proj, ...); stacked:
        of each weight in a stack [E, out, in] (a mixture of experts' experts)."""
        axis = LINEAR_SPLITS[layer] + stacked
        start = self.rank * n_per_rank if self.size > 1 else 0
        index = [slice(None)] * array.ndim
        index[axis] = slice(start, start + n_per_rank)
        return array[tuple(index)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """This rank's logits [L, V / N] → everybody's [L, V]."""
        if self.vocab_range(vocab_size) == (0, vocab_size):
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)


def init_process_group(rank: int, size: int, port: int, device: torch.device) -> None:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


def broadcast(message: Any) -> Any:
    """Rank 0 sends `message` to every rank; the others receive it (and return it)."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Workers:
    """Ranks 1..N-1 of a tensor-parallel torch runner, seen from rank 0: separate Python
    processes (`python -m pagedjax.backends.torch.worker`, which never re-imports the user's
    script), told their runner's arguments through stdin."""

    def __init__(self, runner_args: tuple, size: int) -> None:
        port = _free_port()
        self.processes = []
        for rank in range(1, size):
            process = subprocess.Popen([sys.executable, "-m", _WORKER_MODULE],
                                       stdin=subprocess.PIPE)
            pickle.dump((runner_args, rank, size, port), process.stdin)
            process.stdin.close()
            self.processes.append(process)
        init_process_group(0, size, port, device_of(0))

    def send(self, kind: str, payload: Any = None) -> None:
        broadcast((kind, payload))

    def shutdown(self) -> None:
        """Stop the workers (they leave their loop and exit) and leave the process group."""
        self.send("shutdown")
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        dist.destroy_process_group()


def device_of(rank: int) -> torch.device:
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
