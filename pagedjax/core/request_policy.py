"""Request policies: request-level behaviour outside the scheduler (parallel sampling, beams).

The scheduler schedules sequences; a policy owns what one request does with several of them. It
sees the request's scheduled sequences before the device step (to add sample rows) and the
step's rows after the scheduler's update (to pick tokens), and it forks and drops sequences
through the block manager: a fork shares every block of its parent, and the first write into a
shared partial block is copied (copy-on-write), so siblings and beams hold their common prefix once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedjax.core.batch import ModelOutput
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.scheduler_output import SchedulerOutput
from pagedjax.core.sequence import Sequence
from pagedjax.outputs import RequestOutput


class RequestPolicy(Protocol):
    """What a request does beyond one sampled token per sequence per step."""

    @property
    def done(self) -> bool:
        """Nothing is left for the policy to decide: the engine forgets it."""
        ...

    def schedule(self, out: SchedulerOutput, indices: list[int]) -> None:
        """Before the device step, with the request's scheduled sequences (their indices in
        out.seq_ids): add sample rows (out.forks)."""
        ...

    def update(self, output: ModelOutput, rows: dict[int, int]) -> RequestOutput | None:
        """After the scheduler's update, with the step's rows (seq id → row of `output`): pick
        tokens, fork and drop sequences. Returns the request's output if the policy ended it."""
        ...

    def abort(self) -> None:
        """Finish and forget every sequence the policy holds."""
        ...


@dataclass
class PolicyContext:
    """What policies share with the engine: the scheduler (and its block manager), new ids,
    random streams, EOS ids and the tokenizer."""

    scheduler: Scheduler
    new_seq_id: Callable[[], int]
    fork_seed: Callable[[Sequence, int], int]  # (parent, completion index) -> uint32 stream
    eos_token_ids: tuple[int, ...]
    tokenizer: Any | None

    def fork(self, parent: Sequence, index: int, rng_seed: int = 0) -> Sequence:
        """A new sequence sharing all of parent's tokens and blocks, tracked by the scheduler."""
        child = parent.fork(self.new_seq_id(), index, rng_seed)
        self.scheduler.block_manager.fork(parent.seq_id, child.seq_id)
        self.scheduler.add_fork(child)
        return child

    def drop(self, seq: Sequence, reason: str = "abort") -> None:
        """Finish seq (its blocks go back to the pool) and forget it."""
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
        self.scheduler.remove(seq)


class ParallelSampling:
    """n > 1: the prompt is computed once. The step that samples its first token samples n,
    one row per completion with its own random stream, and forks the n - 1 siblings off the
    parent then, sharing the prompt's blocks (the draft's progress too, as far as this step's
    catch-up takes it). Each sibling then runs as a plain sequence."""

    def __init__(self, parent: Sequence, context: PolicyContext) -> None:
        self.parent = parent
        self.context = context

    @property
    def done(self) -> bool:
        return self.parent.num_pending_forks == 0

    def schedule(self, out: SchedulerOutput, indices: list[int]) -> None:
        parent = self.parent
        for i in indices:
            end = out.num_computed_tokens[i] + out.num_new_tokens[i]
            if (out.seq_ids[i] != parent.seq_id or end != parent.num_tokens
                    or not parent.num_pending_forks):
                continue  # not the parent, or it samples nothing this step
            draft_end = (out.draft_start_pos[i] + out.num_draft_tokens[i]
                         if out.num_draft_tokens else parent.num_draft_computed_tokens)
            children = []
            for k in range(parent.num_pending_forks):
                index = parent.index + 1 + k
                child = self.context.fork(parent, index, self.context.fork_seed(parent, index))
                child.num_draft_computed_tokens = draft_end
                children.append(child.seq_id)
            out.forks[parent.seq_id] = children
            parent.num_pending_forks = 0

    def update(self, output: ModelOutput, rows: dict[int, int]) -> RequestOutput | None:
        return None  # the siblings' tokens are appended by the scheduler like any other

    def abort(self) -> None:
        pass  # the siblings, once forked, are plain sequences of the request
