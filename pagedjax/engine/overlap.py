"""Async scheduling: the engine core launches decode step n + 1 before step n's tokens reach the
host, its input tokens read on the device (vLLM's async scheduling), so that the host's work
between two steps (update, outputs, scheduling) runs while the device computes.

Only decode steps of every running sequence qualify, with nobody waiting and no request policy,
grammar, drafts, penalties, logit bias or banned tokens (those read tokens the host has not
seen: Scheduler.schedule_next), on a runner that launches asynchronously and can read its
inputs on the device. With speculation, that is while the policy drafts nothing
(AdaptiveSpeculation.next_k_is_zero): its next probe ends the run. With a draft model on a
runner with async_speculation (jax; torch on a GPU where PAGEDJAX_ASYNC_SPECULATION=1 asks;
=0: none), speculative steps too, while the policy keeps its k (next_k_is): each is scheduled
as though the one in flight accepted no draft, moved on the device by the drafts it did accept
(backends/*/spec_step.shift_ahead), and its record on the host once that one's tokens arrive
(SchedulerOutput.shift_ahead). With drafts the host proposes (n-gram, suffix), the step
after a plain one too, while the policy keeps offering its k: its drafts are proposed from the
tokens before the one in flight, the first of k + 1 drafts (a guess of that token) dropped
(HostDrafter.propose(lag=True)), and a sequence whose tokens match nothing decodes its token
alone. Any other step runs as before, after the one in flight is collected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedjax import envs
from pagedjax.config import EngineConfig
from pagedjax.core.batch import ModelInput, ModelOutput
from pagedjax.core.model_runner import ModelRunner
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.scheduler_output import SchedulerOutput
from pagedjax.engine.core_messages import EngineCoreOutputs


@dataclass
class Launched:
    """A step launched on the device and not collected yet."""

    out: SchedulerOutput
    model_input: ModelInput
    wait: Callable[[], ModelOutput]  # waits for the step's outputs on the host
    policies: dict[str, list[int]]  # request id → its sequences' indices in out.seq_ids
    constrained: bool  # some row samples under a grammar's mask
    stamps: list[float]  # step start, scheduled, prepared, launched


class StepHost(Protocol):
    """What the overlap needs of the engine core (core.EngineCore)."""

    config: EngineConfig
    runner: ModelRunner
    scheduler: Scheduler
    structured_output: Any
    speculation: Any
    drafter: Any  # the host's drafter (n-gram, suffix; host_drafts.HostDrafter) or None
    input_batch: Any

    def _prepare(self, out: SchedulerOutput) -> ModelInput: ...

    def _collect(self, launched: Launched, outputs: EngineCoreOutputs,
                 during: Callable[[], Any] | None) -> None: ...


class StepOverlap:
    """The engine core's step in flight, and the steps launched ahead of it."""

    def __init__(self, core: StepHost) -> None:
        self.core = core
        self.in_flight: Launched | None = None  # launched, not collected
        self._async_speculation = envs.PAGEDJAX_ASYNC_SPECULATION  # None: the runner's default
        self.num_speculative_ahead = 0  # speculative steps launched before the last's tokens

    def hold(self, launched: Launched) -> None:
        self.in_flight = launched

    def take(self) -> Launched:
        launched, self.in_flight = self.in_flight, None
        return launched

    def drop(self) -> None:
        """Wait for the step in flight and forget it (shutdown)."""
        if self.in_flight is not None:
            self.take().wait()

    def schedules_ahead(self, launched: Launched) -> bool:
        """Whether the next step may be scheduled and launched before this one's tokens
        reach the host (see the module docstring)."""
        model_input = launched.model_input
        if not (self.launches_ahead and not launched.policies
                and not launched.constrained and model_input.entries is None):
            return False
        return ((model_input.layout.decode and (self._no_drafts_next(launched.out)
                                                 or self._host_drafts_next(launched.out) > 0))
                or self._drafts_next(launched.out) > 0)

    @property
    def launches_ahead(self) -> bool:
        """Whether this engine launches steps before the last one's tokens reach the host
        (async scheduling asked, on a runner that launches asynchronously and reads its inputs
        on the device)."""
        runner = self.core.runner
        return bool(self.core.config.async_scheduling and runner.async_launch
                    and runner.async_scheduling)

    @property
    def speculates_ahead(self) -> bool:
        """Whether a draft model's speculative steps may launch ahead on this runner
        (ModelRunner.async_speculation, PAGEDJAX_ASYNC_SPECULATION)."""
        can = self.core.runner.async_speculation
        asked = self._async_speculation
        return can is not False and (bool(can) if asked is None else asked)

    def _drafts_next(self, last: SchedulerOutput) -> int:
        """Async speculation: the k of the draft model's
        speculative step that may launch before `last`'s tokens are known, `last` having
        drafted k for every sequence and the policy's next k being k whatever `last` yields;
        else 0."""
        core, k = self.core, last.num_spec_tokens
        if not (k and self.speculates_ahead and core.scheduler.has_draft
                and all(n == k for n in last.num_spec_tokens_per_seq)):
            return 0
        return k if core.speculation.next_k_is(k, len(last.seq_ids)) else 0

    def _host_drafts_next(self, last: SchedulerOutput) -> int:
        """Drafts from the host (n-gram, suffix): the k the policy offers the step after
        `last` whatever `last` yields, `last` having run no drafts; else 0. That step's drafts
        come from each sequence's tokens before the one `last` samples (Scheduler.
        schedule_next with proposals)."""
        core = self.core
        if core.drafter is None or last.num_spec_tokens or any(last.num_draft_tokens):
            return 0
        return core.speculation.next_k(len(last.seq_ids)) or 0

    def _no_drafts_next(self, last: SchedulerOutput) -> bool:
        """No speculation; or `last` ran no draft (nor a draft model's work) and the policy's
        next k is 0 whatever `last` yields."""
        spec = self.core.speculation
        return spec is None or (not last.num_spec_tokens and not any(last.num_draft_tokens)
                                and spec.next_k_is_zero(len(last.seq_ids)))

    def step_ahead(self, outputs: EngineCoreOutputs,
                   during: Callable[[], Any] | None) -> EngineCoreOutputs:
        """Launch the step after the one in flight (its input tokens are that one's, read on
        the device), then collect the one in flight while the device runs both."""
        core, last = self.core, self.take()
        stamps = [time.perf_counter()]
        out = None
        if not core.structured_output.has_waiting:
            if self._no_drafts_next(last.out):
                out = core.scheduler.schedule_next(last.out)
            elif k := self._drafts_next(last.out):
                out = core.scheduler.schedule_next(last.out, k)
                self.num_speculative_ahead += out is not None
            elif k := self._host_drafts_next(last.out):
                out = core.scheduler.schedule_next(last.out, k, core.drafter.propose(
                    core.scheduler, core.input_batch, k, lag=True))
                self.num_speculative_ahead += out is not None and out.num_spec_tokens > 0
        stamps.append(time.perf_counter())
        model_input = core._prepare(out) if out is not None else None
        stamps.append(time.perf_counter())
        if out is not None:
            self.in_flight = Launched(out, model_input, core.runner.execute_async(model_input),
                                      {}, False, stamps)
        stamps.append(time.perf_counter())
        last.stamps = stamps  # timed as this call's: schedule, prepare, launch, then last's wait
        core._collect(last, outputs, during)
        ahead, seqs = self.in_flight, core.scheduler.seqs
        if ahead is not None and not any(seq_id in seqs and not seqs[seq_id].is_finished
                                         for seq_id in ahead.out.seq_ids):
            self.drop()  # `last` finished every sequence of it: no step() need collect it
        return outputs

