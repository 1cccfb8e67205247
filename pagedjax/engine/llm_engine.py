"""LLMEngine: the offline engine, its parts in one process (vLLM's LLMEngine with an in-process
engine core): a short pipeline.

    add_request → InputProcessor (validate, tokenize) → inbox
    step()      → the inbox into the core and the OutputProcessor
                → EngineCore.step (schedule, prepare, launch, update: token ids)
                → OutputProcessor (text, stop strings, logprobs → RequestOutputs; the stop
                  strings it finds end their completions in the core)

Thread-safe for adds and aborts (AsyncLLM's in-process mode steps on a thread of its own).
Where the runner launches steps asynchronously (an accelerator), a step's outputs are built
while the device runs the next one (vLLM's async output processing): a stop string is then
found a step late, and the completion's one more token dropped. The offline LLM keeps the core
in its process unless asked (LLM(multiprocess=True): core_client.SyncMPClient, where the
outputs and text are built in this process while the core steps in its own): a second process
costs each step a message each way and pays only where a core is free for it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from pagedjax.config import EngineConfig
from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.core.model_runner import ModelRunner
from pagedjax.engine.core import EngineCore
from pagedjax.engine.core_messages import EngineCoreOutputs, EngineCoreRequest
from pagedjax.engine.input_processor import EngineLimits, InputProcessor, PromptType
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedjax.engine_args import EngineArgs

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        core = self.engine_core = EngineCore(config)
        # the parts users and tests look at
        self.config, self.model_config, self.shapes = core.config, core.model_config, core.shapes
        self.tokenizer, self.eos_token_ids = core.tokenizer, core.eos_token_ids
        self.scheduler, self.block_manager = core.scheduler, core.block_manager
        self.input_processor = InputProcessor(self.tokenizer, engine_limits(core), config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._deferred: EngineCoreOutputs | None = None  # built during the next step
        # adds and aborts from any thread, applied by step() in order (the inbox); _pending_ids:
        # ids added but not yet drained (for the duplicate-id check)
        self._inbox: list[tuple[str | None, EngineCoreRequest] | str] = []
        self._pending_ids: set[str] = set()
        self._inbox_lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """An engine for EngineArgs (validated on a copy: the caller's stay as given)."""
        return cls(engine_args.create_engine_config())

    @property
    def runner(self) -> ModelRunner | None:
        return self.engine_core.runner

    @property
    def step_timings(self):
        return self.engine_core.step_timings

    def shutdown(self) -> None:
        """Abort what is in flight and free the device memory (weights, KV caches, compiled
        steps). The engine cannot step afterwards."""
        with self._inbox_lock:
            self._inbox.clear()
            self._pending_ids.clear()
        self.engine_core.shutdown()
        self.output_processor.requests.clear()
        self._deferred = None

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None) -> None:
        """Queue a request (sampled, or beam-searched with BeamSearchParams); it joins at the
        top of the next step. Invalid input raises ValueError here and leaves the engine
        untouched."""
        text, request = self.input_processor.process_inputs(request_id, prompt, params)
        with self._inbox_lock:
            if request_id in self._pending_ids or request_id in self.output_processor.requests:
                raise ValueError(f"request_id={request_id!r} is already in use; pick a unique "
                                 "id.")
            self._pending_ids.add(request_id)
            self._inbox.append((text, request))

    def abort_request(self, request_id: str) -> bool:
        """Finish a request at the top of the next step (finish_reason "abort", its final
        output among that step's outputs) and free its blocks. A request still in the inbox is
        dropped at once, with no output: returns True then. Unknown ids: no-op."""
        with self._inbox_lock:
            if request_id in self._pending_ids:
                self._pending_ids.discard(request_id)
                self._inbox = [c for c in self._inbox
                               if isinstance(c, str) or c[1].request_id != request_id]
                return True
            self._inbox.append(request_id)
            return False

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.output_processor.has_unfinished_requests()

    @property
    def num_generation_tokens(self) -> int:
        """Tokens generated so far (a progress bar's rate)."""
        return self.scheduler.num_generation_tokens_total

    def _drain_inbox(self) -> None:
        """Queued adds and aborts, in order, into the core (and the output processor)."""
        with self._inbox_lock:  # held while applying, so an id is never in neither place
            commands, self._inbox = self._inbox, []
            for command in commands:
                if isinstance(command, str):
                    self.engine_core.abort_requests([command])
                    continue
                text, request = command
                self._pending_ids.discard(request.request_id)
                self.output_processor.add_request(request, text)
                self.engine_core.add_request(request)

    # ---- step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of the engine core; the outputs of the requests that progressed (a step
        late where the runner launches asynchronously, see the module docstring)."""
        detokenized = self.output_processor.detokenize_seconds
        output_seconds = 0.0
        drained = bool(self._inbox)  # adds and aborts see every earlier step's outputs built
        if drained:
            self._drain_inbox()
        deferred, self._deferred = self._deferred, None
        results: list[RequestOutput] = []

        def during() -> None:  # the last step's outputs, while the device runs this one
            nonlocal output_seconds
            start = time.perf_counter()
            results.extend(self._process(deferred))
            output_seconds += time.perf_counter() - start

        core_outputs = self.engine_core.step(during if deferred is not None else None)
        if self._defers_outputs() and not drained and not core_outputs.empty:
            self._deferred = core_outputs
        else:
            start = time.perf_counter()
            results += self._process(core_outputs)
            output_seconds += time.perf_counter() - start
        detokenize_seconds = self.output_processor.detokenize_seconds - detokenized
        self.step_timings.add("output", output_seconds - detokenize_seconds)
        self.step_timings.add("detokenize", detokenize_seconds)
        return results

    def _process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """RequestOutputs from the core's; the stop strings found end their completions."""
        if core_outputs.empty:
            return []
        results, finishes = self.output_processor.process(core_outputs)
        if finishes:
            self.engine_core.finish_sequences(finishes)
        return results

    def _defers_outputs(self) -> bool:
        """Whether a step's outputs are built during the next step: where the runner launches
        steps asynchronously (jax on an accelerator), unless disable_async_output_proc, and
        no step is in flight (async scheduling returns them a step late already)."""
        runner = self.engine_core.runner
        return (runner is not None and runner.async_launch
                and not self.config.disable_async_output_proc
                and self.engine_core.overlap.in_flight is None)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine_core.get_metrics()


def engine_limits(core: EngineCore) -> EngineLimits:
    """What the frontend checks requests against."""
    return EngineLimits(core.model_config.vocab_size, core.config.max_model_len,
                        core.config.max_num_seqs, core.shapes.num_logit_entries,
                        tuple(core.eos_token_ids))
