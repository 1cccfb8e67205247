"""LLMEngine: add requests, step the scheduler and a backend's runner, stream outputs.

One step: drain the inbox of add/abort commands → admit constrained requests whose grammar is
compiled → the speculation policy picks k → Scheduler.schedule → request policies add sample
rows (n > 1) → the grammars' token bitmask → build_model_input (NumPy) → ModelRunner.execute
(one device step) → grammars check the tokens → Scheduler.update (token-level stops, rollback) →
OutputProcessor (text, stop strings, logprobs, outputs) → request policies pick tokens, fork
and drop (beam search).

Before the first request the engine has its runner compile every step shape it can ever run
(the closed set of core/step_shapes.py) and, with an adaptive draft, times each k at each batch
bucket once (the speculation policy's cost table).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pagedjax.cache import cache_dir, compile_at_startup, compile_cache_enabled
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import ModelInput, ModelOutput
from pagedjax.core.beam_search import BeamSearch, BeamSearchParams
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.input_batch import InputBatch
from pagedjax.core.model_runner import ModelRunner, get_runner_cls
from pagedjax.core.request_policy import ParallelSampling, PolicyContext, RequestPolicy
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput
from pagedjax.core.sequence import Sequence
from pagedjax.core.spec_decode import (
    AdaptiveSpeculation,
    SpeculativeConfig,
    StepCosts,
    measure_step_costs,
)
from pagedjax.core.step_shapes import StepShapes
from pagedjax.core.stopping import StopChecker
from pagedjax.distributed import freeze_gc_heap, register_engine, unfreeze_gc_heap
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.gguf_loader import resolve_model_source
from pagedjax.outputs import RequestOutput
from pagedjax.parallel import TensorParallelPlan
from pagedjax.random import derive_seed
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedjax.structured_output import StructuredOutputManager
from pagedjax.tokenizer import load_eos_token_ids, load_tokenizer

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt": text).
PromptType = str | dict[str, Any]
logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step launched on the device and not collected yet."""

    out: SchedulerOutput
    model_input: ModelInput
    wait: Callable[[], ModelOutput]  # waits for the step's outputs on the host
    policies: dict[str, list[int]]  # request id → its sequences' indices in out.seq_ids
    bitmask: np.ndarray | None
    stamps: list[float]  # step start, scheduled, prepared, launched


@dataclass(frozen=True)
class _AddCommand:
    """A validated request waiting in the inbox."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    beam_params: BeamSearchParams | None = None  # beam search: its policy picks the tokens
    grammar: str | None = None  # structured outputs: the llguidance grammar


# launch: the runner's call that starts the step (the whole step where it runs as called);
# execute: waiting for its outputs; output: RequestOutputs, stop strings, logprobs, without
# detokenize (text)
STEP_PHASES = ("schedule", "prepare", "launch", "execute", "update", "output", "detokenize")


@dataclass
class StepTimings:
    """Wall seconds spent in each phase of LLMEngine.step, summed over steps."""

    num_steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def record(self, stamps: list[float], detokenize_seconds: float) -> None:
        """stamps: the ends of the phases before detokenize (which the output phase's time
        includes), after the step's start."""
        self.num_steps += 1
        for name, start, end in zip(STEP_PHASES, stamps, stamps[1:]):
            self.seconds[name] += end - start
        self.seconds["output"] -= detokenize_seconds
        self.seconds["detokenize"] += detokenize_seconds


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.model = resolve_model_source(config.model)  # a GGUF file: its HF conversion
        if not Path(config.model).is_dir():
            raise ValueError(f"model={config.model!r} is not a directory; pass a Hugging Face "
                             "checkpoint directory (config.json, *.safetensors, tokenizer files) "
                             "or a .gguf file.")
        runner_cls = get_runner_cls(config.backend)
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        config.validate(self.model_config, runner_cls.default_dtype(self.model_config))
        TensorParallelPlan.for_model(self.model_config, config.tensor_parallel_size)  # it splits
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = load_eos_token_ids(config.model, self.tokenizer)
        spec_config = draft_model_config = None
        if config.speculative_config is not None:
            spec_config = SpeculativeConfig.from_dict(config.speculative_config,
                                                      config.tensor_parallel_size)
            draft_model_config = self._check_draft(spec_config)
        self.shapes = StepShapes.for_engine(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_blocks_per_seq=config.max_blocks_per_seq, max_model_len=config.max_model_len,
            num_speculative_tokens=spec_config.num_speculative_tokens if spec_config else 0,
            min_num_seqs=runner_cls.min_decode_rows())
        self.runner: ModelRunner | None = runner_cls(config, self.model_config,
                                                     draft_model_config, self.shapes)
        self.startup_compile_seconds = self._compile()
        self.speculation: AdaptiveSpeculation | None = None
        if spec_config is not None:
            costs = None
            if spec_config.adaptive and compile_at_startup():
                costs = self._step_costs()
            elif spec_config.adaptive:
                logger.info("PAGEDJAX_COMPILE_AT_STARTUP=0: speculation keeps k = %d fixed (the "
                            "adaptive policy's step-time table would compile every speculative "
                            "step)", spec_config.num_speculative_tokens)
            self.speculation = AdaptiveSpeculation(spec_config, self.shapes, costs)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            stop_checker=StopChecker(self.eos_token_ids, config.max_model_len),
            has_draft=self.speculation is not None,
            max_logit_entries=self.shapes.num_logit_entries)
        self.input_batch = InputBatch(self.shapes, block_size=config.block_size,
                                      max_model_len=config.max_model_len,
                                      eos_token_ids=self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.policy_context = PolicyContext(self.scheduler, lambda: next(self._seq_ids),
                                            self._rng_seed, self.eos_token_ids, self.tokenizer)
        self.policies: dict[str, RequestPolicy] = {}  # request id → its policy, while it has one
        self.prompt_tokens_total = 0
        self.step_timings = StepTimings()
        # (touched sequences, model output) of the last step, whose outputs the next step builds
        # while the device runs it (async output processing; _defers_outputs)
        self._deferred: tuple[list[Sequence], ModelOutput] | None = None
        self._in_flight: _Launched | None = None  # async scheduling: launched, not collected
        # add/abort commands from any thread, applied by step() in order (the inbox);
        # _pending_ids: ids added but not yet drained (for the duplicate-id check)
        self._inbox: list[_AddCommand | str] = []
        self._pending_ids: set[str] = set()
        self._inbox_lock = threading.Lock()
        register_engine(self)
        freeze_gc_heap()  # startup's objects leave the collector's full passes (distributed.py)

    def shutdown(self) -> None:
        """Abort what is in flight and free the device memory (weights, KV caches, compiled
        steps). The engine cannot step afterwards."""
        if self.runner is None:
            return
        unfreeze_gc_heap()  # what this engine drops becomes collectable
        if self._in_flight is not None:
            self._in_flight.wait()  # its device work ends before the arrays are deleted
            self._in_flight = None
        with self._inbox_lock:
            self._inbox.clear()
            self._pending_ids.clear()
        for request_id in list(self.output_processor.requests):
            self._abort_now(request_id)
        self.runner.shutdown()
        self.runner = None
        self.structured_output.shutdown()

    def _compile(self) -> float:
        """Compile (JAX) or capture (CUDA graphs) every step shape before the first request,
        with a progress bar and one log line; returns the seconds it took."""
        layouts = self.shapes.layouts()
        if not compile_at_startup():
            logger.info("PAGEDJAX_COMPILE_AT_STARTUP=0: each of the %d step shapes compiles "
                        "when a step first needs it", len(layouts))
            return 0.0
        plan = self.runner.compile_plan(layouts)
        start = time.perf_counter()
        with tqdm(total=len(plan), desc="Compiling step shapes", unit="shape",
                  disable=not plan) as bar:
            self.runner.compile(layouts, bar.update)
        seconds = time.perf_counter() - start
        logger.info("%d step shapes ready in %.1f s (%d compiled or captured, %d of them "
                    "loaded from the compile cache)", len(layouts), seconds, len(plan),
                    self.runner.num_cache_hits)
        return seconds

    def _step_costs(self) -> StepCosts:
        """The speculation policy's cost table: measured once per runner (device, code,
        shapes) and kept in pagedjax's cache folder beside the compiled steps."""
        key = hashlib.sha256(f"{self.runner.cache_key()}|{self.shapes!r}".encode()).hexdigest()
        path = cache_dir() / "step_costs" / f"{key[:32]}.json"
        if compile_cache_enabled() and path.is_file():
            table = json.loads(path.read_text())
            return {int(s): {int(k): t for k, t in row.items()} for s, row in table.items()}
        costs = measure_step_costs(self.runner.execute, self.shapes, self.config,
                                   self.runner.num_kv_blocks)
        if compile_cache_enabled():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(costs))
            tmp.replace(path)
        logger.info("step costs (ms) by batch bucket and k: %s", {
            s: {k: round(1e3 * t, 2) for k, t in row.items()} for s, row in costs.items()})
        return costs

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        """An engine for EngineArgs (validated on a copy: the caller's stay as given)."""
        return cls(EngineConfig(**{f.name: getattr(engine_args, f.name)
                                   for f in dataclasses.fields(EngineConfig)}))

    def _check_draft(self, spec_config: SpeculativeConfig) -> ModelConfig:
        draft_model_config = ModelConfig.from_pretrained(spec_config.model)
        spec_config.check_vocabulary(self.config.model, self.tokenizer,
                                     load_tokenizer(spec_config.model),
                                     self.model_config.vocab_size, draft_model_config.vocab_size)
        if draft_model_config.max_position_embeddings < self.config.max_model_len:
            raise ValueError(f"draft max_position_embeddings="
                             f"{draft_model_config.max_position_embeddings} is below "
                             f"max_model_len={self.config.max_model_len}; lower max_model_len.")
        return draft_model_config

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None) -> None:
        """Queue a request (sampled, or beam-searched with BeamSearchParams); it joins at the
        top of the next step. Invalid input raises ValueError here and leaves the engine
        untouched. Thread-safe: another thread may be stepping (the server's engine loop)."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        beam_params = params if isinstance(params, BeamSearchParams) else None
        if beam_params is not None:
            params = self._beam_sampling_params(beam_params)
        max_tokens = self._check_lengths(token_ids, params)
        self._check_logit_bias(params)
        self._check_logit_entries(token_ids, params, max_tokens)
        grammar = None  # (BeamSearchParams carry no constraint: beams are never constrained)
        if params.structured_outputs is not None:
            grammar = self.structured_output.check(params)
        with self._inbox_lock:
            if request_id in self._pending_ids or request_id in self.output_processor.requests:
                raise ValueError(f"request_id={request_id!r} is already in use; pick a unique "
                                 "id.")
            self._pending_ids.add(request_id)
            self._inbox.append(_AddCommand(request_id, text, token_ids, params, max_tokens,
                                           beam_params, grammar))

    def _apply_add(self, command: _AddCommand) -> None:
        request_id, token_ids, params = command.request_id, command.token_ids, command.params
        arrival = next(self._arrivals)
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=request_id, index=0,
            arrival=(arrival, 0), token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
            sampling_params=params, max_tokens=command.max_tokens, rng_seed=0,
            num_pending_forks=params.n - 1)
        seq.rng_seed = self._rng_seed(seq, 0)
        if command.beam_params is not None:
            self.policies[request_id] = BeamSearch(seq, command.beam_params, command.prompt,
                                                   self.policy_context)
        elif params.n > 1:
            self.policies[request_id] = ParallelSampling(seq, self.policy_context)
        self.output_processor.add_request(request_id, command.prompt, seq)
        if command.grammar is not None:  # scheduled once its grammar is compiled
            self.structured_output.add_request(seq, command.grammar)
        else:
            self.scheduler.add_sequence(seq)
        self.prompt_tokens_total += len(token_ids)

    def _beam_sampling_params(self, params: BeamSearchParams) -> SamplingParams:
        """What the beams of a request sample with; raises ValueError for a width this engine
        cannot serve."""
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(f"BeamSearchParams.beam_width={params.beam_width} exceeds "
                             f"max_num_seqs={self.config.max_num_seqs}; lower beam_width or "
                             "raise max_num_seqs.")
        num_candidates = params.num_candidates(len(self.eos_token_ids))
        limit = min(MAX_LOGPROBS, self.model_config.vocab_size)
        if num_candidates > limit:
            per_beam = num_candidates // params.beam_width
            raise ValueError(f"BeamSearchParams.beam_width={params.beam_width} needs the top "
                             f"{num_candidates} logprobs per beam, over the {limit} a step "
                             f"returns; use beam_width <= {limit // per_beam}.")
        return params.sampling_params(num_candidates)

    def _drain_inbox(self) -> list[RequestOutput]:
        """Apply queued adds and aborts in order; the final outputs of the aborted requests."""
        aborted = []
        with self._inbox_lock:  # held while applying, so an id is never in neither place
            commands, self._inbox = self._inbox, []
            for command in commands:
                if isinstance(command, _AddCommand):
                    self._pending_ids.discard(command.request_id)
                    self._apply_add(command)
                else:
                    output = self._abort_now(command)
                    if output is not None:
                        aborted.append(output)
        return aborted

    def _abort_now(self, request_id: str) -> RequestOutput | None:
        """Finish a request (its policy's sequences too) and forget it; its final output."""
        policy = self.policies.pop(request_id, None)
        if policy is not None:
            policy.abort()
        return self.output_processor.abort_request(request_id)

    def _rng_seed(self, seq: Sequence, index: int) -> int:
        seed = seq.sampling_params.seed
        if seed is not None:  # reproducible whatever else is in flight
            return derive_seed(seed, index)
        return derive_seed(self.config.seed, seq.arrival[0], index)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer; pass "
                                 "{'prompt_token_ids': [...]} instead of text.")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            raise TypeError(f"prompt={prompt!r} must be a string or a dict with "
                            "'prompt_token_ids'.")
        if not token_ids:
            raise ValueError(f"prompt={prompt!r} is empty; give at least one token.")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                             "tokenize with this model's tokenizer.")
        return text, [int(t) for t in token_ids]

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len = self.config.max_model_len
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs="
                             f"{self.config.max_num_seqs}; lower n or raise max_num_seqs.")
        room = max_len - len(token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={max_len}; shorten the prompt, lower max_tokens or raise "
                "max_model_len.")
        return max_tokens

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = sorted(t for t in params.logit_bias or () if t >= vocab)
        if bad:
            raise ValueError(f"SamplingParams.logit_bias has token ids {bad[:5]} outside the "
                             f"vocabulary [0, {vocab}); use this model's token ids.")

    def _check_logit_entries(self, token_ids: list[int], params: SamplingParams,
                             max_tokens: int) -> None:
        """The request's rows must fit one step's logit entries (logit_entries.py) even at
        their largest: n rows with their logit_bias, banned tokens and penalties' tokens."""
        per_row = len(params.logit_bias or ()) + len(params.stop_token_ids) + len(
            self.eos_token_ids)
        if params.has_penalties:
            per_row += max_tokens + (len(set(token_ids))
                                     if params.repetition_penalty != 1.0 else 0)
        capacity = self.shapes.num_logit_entries
        if params.n * per_row > capacity:
            raise ValueError(
                f"SamplingParams n={params.n} with these penalties, logit_bias and stop tokens "
                f"needs up to {params.n * per_row} logit entries per step, over this engine's "
                f"{capacity} (4 x max_model_len); lower n, max_tokens or the logit_bias, or "
                "raise max_model_len.")

    def abort_request(self, request_id: str) -> bool:
        """Finish a request at the top of the next step (finish_reason "abort", its final
        output among that step's outputs) and free its blocks. A request still in the inbox is
        dropped at once, with no output: returns True then. Unknown ids: no-op. Thread-safe."""
        with self._inbox_lock:
            if request_id in self._pending_ids:
                self._pending_ids.discard(request_id)
                self._inbox = [c for c in self._inbox
                               if not (isinstance(c, _AddCommand) and c.request_id == request_id)]
                return True
            self._inbox.append(request_id)
            return False

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.output_processor.has_unfinished_requests()

    # ---- step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step and one device step; outputs of the requests that progressed.
        With async scheduling a decode step may stay in flight: step() launches the next one
        before it collects it, and returns its outputs then (a step late)."""
        if self.runner is None:
            raise RuntimeError("this engine was shut down; make a new one")
        if self._in_flight is not None and not self._inbox:
            return self._step_ahead()
        # aborts and adds see every earlier step's outputs built
        flushed = self._collect(self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        flushed += self._flush_outputs() if self._inbox else []
        aborted = self._drain_inbox() if self._inbox else []
        if self.structured_output.has_waiting:
            aborted += self._admit_constrained()
        if self.structured_output.has_matchers:
            self.structured_output.release()  # the completions finished or aborted since
        stamps = [time.perf_counter()]
        k = self._choose_num_spec_tokens()
        out = self.scheduler.schedule(k)
        if out.is_empty:
            self._apply_changes(out)
            flushed += self._flush_outputs()
            if self.structured_output.has_waiting and not flushed:  # only grammars compiling
                self.structured_output.wait(timeout=0.05)
            return flushed + aborted
        policies = self._policies_of(out)
        for request_id, indices in policies.items():
            self.policies[request_id].schedule(out, indices)
        for children in out.forks.values():
            for child in children:
                self.output_processor.add_fork(self.scheduler.seqs[child])
        stamps.append(time.perf_counter())
        model_input = self._prepare(out)
        bitmask = None
        if self.structured_output.has_matchers:
            seqs = self.scheduler.seqs
            bitmask = self.structured_output.bitmask([seqs[i] for i in model_input.seq_ids])
            if bitmask is not None:  # the rows filled ahead meanwhile, copied in
                model_input.set_token_bitmask(bitmask)
                self.structured_output.finish_bitmask(model_input.token_bitmask)
        stamps.append(time.perf_counter())
        launched = _Launched(out, model_input, self.runner.execute_async(model_input), policies,
                             bitmask, stamps)
        stamps.append(time.perf_counter())
        if self._schedules_ahead(launched):
            self._in_flight = launched  # the next step() launches its successor first
            return flushed + aborted
        return flushed + aborted + self._collect(launched)

    def _prepare(self, out: SchedulerOutput) -> ModelInput:
        """The step's input, from the persistent batch."""
        return self.input_batch.prepare(out, self.scheduler.seqs, self.block_manager.tables)

    def _apply_changes(self, out: SchedulerOutput) -> None:
        """What changed, into the persistent batch, for a step that runs nothing."""
        self.input_batch.apply(out, self.scheduler.seqs, self.block_manager.tables)

    def _schedules_ahead(self, launched: _Launched) -> bool:
        """Whether the next step may be scheduled and launched before this one's tokens reach
        the host (async scheduling): decode steps without request policies, grammars or
        speculation, where the runner launches asynchronously and reads inputs on the device;
        not where a row has penalties, logit bias or banned tokens (penalties count tokens the
        host has not seen: Scheduler.schedule_next)."""
        model_input = launched.model_input
        return (self.config.async_scheduling and self.runner.async_launch
                and self.runner.async_scheduling and not launched.policies
                and launched.bitmask is None and self.speculation is None
                and model_input.layout.decode and model_input.entries is None)

    def _step_ahead(self) -> list[RequestOutput]:
        """Async scheduling: launch the step after the one in flight (its input tokens are that
        one's, read on the device), then collect the one in flight while the device runs it."""
        last, self._in_flight = self._in_flight, None
        stamps = [time.perf_counter()]
        out = None
        if not self.structured_output.has_waiting:
            out = self.scheduler.schedule_next(last.out)
        stamps.append(time.perf_counter())
        model_input = self._prepare(out) if out is not None else None
        stamps.append(time.perf_counter())
        if out is not None:
            self._in_flight = _Launched(out, model_input, self.runner.execute_async(model_input),
                                        {}, None, stamps)
        stamps.append(time.perf_counter())
        last.stamps = stamps  # timed as this call's: schedule, prepare, launch, then last's wait
        outputs = self._collect(last)
        ahead, seqs = self._in_flight, self.scheduler.seqs
        if ahead is not None and not any(seq_id in seqs and not seqs[seq_id].is_finished
                                         for seq_id in ahead.out.seq_ids):
            ahead.wait()  # `last` finished every sequence of it: no step() need collect it
            self._in_flight = None
        return outputs

    def _collect(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step, advance the scheduler by its tokens and build (or defer)
        its outputs, building the last step's deferred ones while the device runs."""
        out, model_input, policies, bitmask = (launched.out, launched.model_input,
                                               launched.policies, launched.bitmask)
        stamps = launched.stamps[:4]
        detokenize_start = self.output_processor.detokenize_seconds
        flush_start = time.perf_counter()
        flushed = self._flush_outputs()  # the last step's, while the device runs this one
        flush_seconds = time.perf_counter() - flush_start
        model_output = launched.wait()
        # the flush is timed as output work: the execute and update stamps move back by it
        stamps.append(time.perf_counter() - flush_seconds)
        # a row of a sequence that the last step's outputs finished (a stop string) is dropped
        seqs = self.scheduler.seqs
        sampled = SampledTokens.from_array(model_output.seq_ids, model_output.sampled_token_ids)
        if bitmask is not None:  # each row cut at a token its grammar forbids
            for seq in self.structured_output.accept(seqs, sampled, model_input.num_spec_tokens):
                self.scheduler.mark_changed(seq)
        touched = self.scheduler.update(out, sampled)
        self.input_batch.append_sampled(sampled, model_input)
        if bitmask is not None:
            for seq in self.structured_output.stopped(touched):
                self.scheduler.finish(seq, "stop")  # its grammar is complete
            if self.runner.idle_cores_between_steps:  # the next step's rows, meanwhile
                self.structured_output.fill_ahead(touched)
        stamps.append(time.perf_counter() - flush_seconds)
        if self._defers_outputs(policies, bitmask) and self._in_flight is None:
            self._deferred, outputs = (touched, model_output), []
        else:
            outputs = self.output_processor.process(touched, model_output)
        if policies:
            outputs += self._update_policies(policies, model_output)
        if self.structured_output.has_matchers:
            self.structured_output.release()  # the completions that finished
        stamps.append(time.perf_counter())
        self.step_timings.record(
            stamps, self.output_processor.detokenize_seconds - detokenize_start)
        if self.speculation is not None:
            self.speculation.observe(out, sampled)
        if not self.scheduler.has_unfinished():  # the last rows free now, not at the next step
            self._apply_changes(self.scheduler.take_changes())
        return flushed + outputs

    def _defers_outputs(self, policies: dict, bitmask: np.ndarray | None) -> bool:
        """Whether this step's outputs are built during the next step (async output
        processing): where the runner launches steps asynchronously, and the step has no
        request policy (beams pick tokens from the outputs), no speculation and no grammar
        (their bookkeeping reads every sequence's tokens before the next step). A stop string
        is then found a step late: the sequence computes one more token, dropped."""
        return (self.runner.async_launch and not self.config.disable_async_output_proc
                and not policies and self.speculation is None and bitmask is None)

    def _flush_outputs(self) -> list[RequestOutput]:
        """The outputs of a deferred step, built now."""
        if self._deferred is None:
            return []
        (touched, model_output), self._deferred = self._deferred, None
        return self.output_processor.process(touched, model_output)

    def _admit_constrained(self) -> list[RequestOutput]:
        """Schedule the constrained requests whose grammar is compiled now; abort those whose
        grammar failed (their final outputs)."""
        ready, failed = self.structured_output.take_ready()
        for seq in ready:
            self.scheduler.add_sequence(seq)
        aborted = []
        for seq, error in failed:
            logger.error("request %s: its structured output grammar failed (%s); aborted",
                         seq.request_id, error)
            output = self._abort_now(seq.request_id)
            if output is not None:
                aborted.append(output)
        return aborted

    def _policies_of(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """The scheduled sequences (indices in out.seq_ids) of each request with a policy."""
        policies: dict[str, list[int]] = {}
        if self.policies:
            seqs = self.scheduler.seqs
            for i, seq_id in enumerate(out.seq_ids):
                request_id = seqs[seq_id].request_id
                if request_id in self.policies:
                    policies.setdefault(request_id, []).append(i)
        return policies

    def _update_policies(self, policies: dict[str, list[int]],
                         model_output: ModelOutput) -> list[RequestOutput]:
        """Let the policies of the step's requests pick tokens, fork and drop; returns the
        outputs of the requests they ended (the output processor forgets those)."""
        rows = {seq_id: r for r, seq_id in enumerate(model_output.seq_ids)}
        outputs = []
        for request_id in policies:
            policy = self.policies[request_id]
            output = policy.update(model_output, rows)
            if policy.done:
                del self.policies[request_id]
            if output is not None:
                # Its policy built its output: the output processor only forgets it.
                self.output_processor.remove_request(request_id)
                outputs.append(output)
        return outputs

    def _choose_num_spec_tokens(self) -> int:
        if self.speculation is None:
            return 0
        sched = self.scheduler
        num_seqs = min(len(sched.running) + len(sched.waiting), self.config.max_num_seqs)
        return self.speculation.choose(max(num_seqs, 1))

    # ---- metrics -----------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, Any]:
        bm, sched = self.block_manager, self.scheduler
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "num_requests_running": len({s.request_id for s in sched.running}),
            "num_requests_waiting": len({s.request_id for s in sched.waiting}
                                        - {s.request_id for s in sched.running}),
            "num_preemptions_total": sched.num_preemptions_total,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": sched.num_generation_tokens_total,
            # the closed set of step shapes, its startup compile, and compiles since (a bug)
            "num_step_shapes": len(self.shapes.layouts()),
            "startup_compile_seconds": self.startup_compile_seconds,
            "num_compiles_after_startup": self.runner.num_compiles if self.runner else 0,
            "compile_cache_hits": self.runner.num_cache_hits if self.runner else 0,
            **self.structured_output.metrics(),
            **(self.speculation.as_dict() if self.speculation else {}),
        }
