"""EngineCore: the scheduler, the persistent batch and a backend's runner, stepped.

One step: apply the requests, aborts and stop-string finishes that came in → admit constrained
requests whose grammar is compiled → the speculation policy picks k → Scheduler.schedule →
request policies add sample rows (n > 1) → InputBatch.prepare (+ the grammars' bitmask) →
ModelRunner.execute_async → grammars check the tokens → Scheduler.update and the batch's
appends → the tokens of the completions whose request wants them now (EngineCoreOutputs) →
request policies pick tokens, fork and drop (beam search).

It sees token ids only: text (detokenization, stop strings) is the frontend's
(output_processor.py), in this process (LLMEngine) or another (core_client.py). Async
scheduling (overlap.py) launches a decode step before the last one's tokens reach the host.

Before the first request the core has its runner compile every step shape it can ever run (the
closed set of core/step_shapes.py) and, with an adaptive draft, times each k at each batch
bucket once (step_costs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagedjax.cache import compile_at_startup
from pagedjax.config import EngineConfig, ModelConfig, quantized_experts_error
from pagedjax.core.batch import ModelInput, ModelOutput
from pagedjax.core.beam_search import BeamSearch
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.host_drafts import ShadowDrafts, make_host_drafter
from pagedjax.core.input_batch import InputBatch
from pagedjax.core.model_runner import ModelRunner, get_runner_cls
from pagedjax.core.request_policy import ParallelSampling, PolicyContext, RequestPolicy
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput
from pagedjax.core.sequence import Sequence
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.core.spec_policy import AdaptiveSpeculation
from pagedjax.core.step_shapes import StepShapes
from pagedjax.core.stopping import StopChecker
from pagedjax.distributed.parallel_state import register_engine
from pagedjax.distributed.tensor_parallel import TensorParallelPlan
from pagedjax.engine.core_messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishSequence,
    PromptLogprobs,
    SeqLogprobs,
    SeqOutput,
)
from pagedjax.engine.overlap import Launched, StepOverlap
from pagedjax.engine.stats import StepTimings
from pagedjax.engine.step_costs import step_costs
from pagedjax.model_loader.gguf import gguf_experts, gguf_file, resolve_model_source
from pagedjax.model_loader.tokenizer import load_eos_token_ids, load_tokenizer
from pagedjax.reasoning.token_ids import engine_reasoning_parser
from pagedjax.rng import derive_seed
from pagedjax.sampling_params import RequestOutputKind
from pagedjax.structured_output import StructuredOutputManager
from pagedjax.utils.gc_utils import freeze_gc_heap, unfreeze_gc_heap

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the device (through its runner) and every sequence; steps on token ids."""

    def __init__(self, config: EngineConfig) -> None:
        source = gguf_file(config.model)
        if source is not None:
            config.gguf_path = str(source)
            architecture, num_experts = gguf_experts(source)
            if num_experts and config.quantization is not None:  # before a long conversion
                raise ValueError(quantized_experts_error(f"{source.name} ({architecture})",
                                                         config.quantization))
            if config.quantization is None:
                logger.info("%s: dequantized to float32 at load; quantization='gguf' keeps its "
                            "Q8_0/Q4_0/Q4_1 blocks (torch backend, CPU)", source.name)
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
        reasoner = engine_reasoning_parser(config.reasoning_parser, self.tokenizer)  # checked
        spec_config = draft_model_config = None
        if config.speculative_config is not None:  # the runners read the typed one
            spec_config = config.speculative_config = SpeculativeConfig.from_dict(
                config.speculative_config, config.tensor_parallel_size)
            if spec_config.uses_draft_model:
                draft_model_config = spec_config.draft_model_config(
                    config.model, self.tokenizer, self.model_config, config.max_model_len)
        self.shapes = StepShapes.for_engine(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_blocks_per_seq=config.max_blocks_per_seq, max_model_len=config.max_model_len,
            num_speculative_tokens=spec_config.num_speculative_tokens if spec_config else 0,
            min_num_seqs=runner_cls.min_decode_rows(),
            draft_model=draft_model_config is not None)
        self.runner: ModelRunner | None = runner_cls(config, self.model_config,
                                                     draft_model_config, self.shapes)
        self.startup_compile_seconds = self._compile()
        self.speculation = self._speculation(spec_config)
        self._last_output_time: float | None = None  # perf_counter of the last step's outputs
        self.drafter = None if spec_config is None else make_host_drafter(spec_config)
        self.shadow_drafts = (  # the host's drafts scored while the policy drafts nothing
            ShadowDrafts(self.drafter, spec_config.num_speculative_tokens)
            if self.drafter is not None and self.speculation.adaptive else None)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            stop_checker=StopChecker(self.eos_token_ids, config.max_model_len),
            has_draft=draft_model_config is not None,
            host_drafts=spec_config is not None and not spec_config.uses_draft_model,
            max_logit_entries=self.shapes.num_logit_entries)
        self.input_batch = InputBatch(self.shapes, block_size=config.block_size,
                                      max_model_len=config.max_model_len,
                                      eos_token_ids=self.eos_token_ids)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids, reasoner)
        self._next_seq_id = 0
        self._num_arrivals = 0
        self.policy_context = PolicyContext(self.scheduler, self._new_seq_id, self._rng_seed,
                                            self.eos_token_ids, self.tokenizer)
        self.policies: dict[str, RequestPolicy] = {}  # request id → its policy, while it has one
        self.requests: dict[str, list[Sequence]] = {}  # request id → its live completions
        self.prompt_tokens_total = 0
        self.step_timings = StepTimings()
        self.overlap = StepOverlap(self)
        if self.speculation is not None:  # its steps' periods: see AdaptiveSpeculation.chains
            self.speculation.chains = self.overlap.speculates_ahead and self.scheduler.has_draft
            self.speculation.zero_ahead = (self.overlap.launches_ahead
                                           and not self.scheduler.has_draft)
        # what arrived since the last step: applied at its top, after a step in flight
        self._pending: list[EngineCoreRequest | str] = []
        register_engine(self)
        freeze_gc_heap()  # startup's objects leave the collector's full passes (gc_utils.py)

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

    def _speculation(self, spec_config: SpeculativeConfig | None) -> AdaptiveSpeculation | None:
        if spec_config is None:
            return None
        costs = None
        if spec_config.adaptive and compile_at_startup():
            costs = step_costs(self.runner, self.shapes, self.config)
        elif spec_config.adaptive:
            logger.info("PAGEDJAX_COMPILE_AT_STARTUP=0: speculation keeps k = %d fixed (the "
                        "adaptive policy's step-time table would compile every speculative "
                        "step)", spec_config.num_speculative_tokens)
        return AdaptiveSpeculation(spec_config, self.shapes, costs)

    def shutdown(self) -> None:
        """Abort what is in flight and free the device memory (weights, KV caches, compiled
        steps). The core cannot step afterwards."""
        if self.runner is None:
            return
        unfreeze_gc_heap()  # what this engine drops becomes collectable
        self.overlap.drop()  # its device work ends before the arrays are deleted
        self._pending.clear()
        for request_id in list(self.requests):
            self._abort(request_id, EngineCoreOutputs())
        self.runner.shutdown()
        self.runner = None
        self.structured_output.shutdown()

    # ---- requests: applied at the top of the next step ---------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self._pending.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each ends at the top of the next step, with finish_reason "abort" (its final
        outputs among that step's)."""
        self._pending.extend(request_ids)

    def finish_sequences(self, finishes: list[FinishSequence]) -> None:
        """Completions whose stop string the frontend found: each ends where it says (its
        tokens after it dropped), now; a step in flight appends none to them."""
        for finish in finishes:
            seq = next((s for s in self.requests.get(finish.request_id, ())
                        if s.index == finish.index), None)
            if seq is None or seq.is_finished:
                continue
            self.scheduler.finish(seq, "stop", finish.stop_reason,
                                  num_output_tokens=finish.num_output_tokens)
            self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending or self.requests or self.overlap.in_flight)

    def _apply_pending(self, outputs: EngineCoreOutputs | None = None) -> None:
        """What arrived since the last step; aborted requests' final outputs into `outputs`."""
        outputs = EngineCoreOutputs() if outputs is None else outputs
        pending, self._pending = self._pending, []
        for command in pending:
            if isinstance(command, EngineCoreRequest):
                self._add(command)
            else:
                self._abort(command, outputs)

    def _add(self, request: EngineCoreRequest) -> None:
        params = request.params
        self._num_arrivals += 1
        seq = Sequence(
            seq_id=self._new_seq_id(), request_id=request.request_id, index=0,
            arrival=(self._num_arrivals, 0), token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids), sampling_params=params,
            max_tokens=request.max_tokens, rng_seed=0, num_pending_forks=params.n - 1,
            outputs_every_step=(params.output_kind is not RequestOutputKind.FINAL_ONLY
                                or bool(params.stop_strings) or params.logprobs is not None))
        seq.rng_seed = self._rng_seed(seq, 0)
        if request.beam_params is not None:
            self.policies[request.request_id] = BeamSearch(seq, request.beam_params, None,
                                                           self.policy_context)
        elif params.n > 1:
            self.policies[request.request_id] = ParallelSampling(seq, self.policy_context)
        self.requests[request.request_id] = [seq]
        if request.grammar is not None:  # scheduled once its grammar is compiled
            self.structured_output.add_request(seq, request.grammar)
        else:
            self.scheduler.add_sequence(seq)
        self.prompt_tokens_total += len(request.prompt_token_ids)

    def _abort(self, request_id: str, outputs: EngineCoreOutputs) -> None:
        """Finish every completion of the request ("abort"), with its final output."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return
        policy = self.policies.pop(request_id, None)
        if policy is not None:
            policy.abort()
        if isinstance(policy, BeamSearch):  # its beams are its policy's: one output of them
            outputs.outputs.append(SeqOutput(request_id, 0, [], "abort"))
            return
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                outputs.outputs.append(self._seq_output(seq))
            self.scheduler.remove(seq)

    def _forget(self, seq: Sequence) -> None:
        """seq finished and its last tokens went out: the core forgets it (and its request
        with its last completion)."""
        self.scheduler.remove(seq)
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs) and not seqs[0].num_pending_forks:
            del self.requests[seq.request_id]

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _rng_seed(self, seq: Sequence, index: int) -> int:
        seed = seq.sampling_params.seed
        if seed is not None:  # reproducible whatever else is in flight
            return derive_seed(seed, index)
        return derive_seed(self.config.seed, seq.arrival[0], index)

    # ---- step --------------------------------------------------------------------------------

    def step(self, during: Callable[[], Any] | None = None) -> EngineCoreOutputs:
        """One scheduler step and one device step; the tokens of the completions that
        progressed, as their requests want them. during(), when given, runs once while the
        device computes (or at the end, if no step ran): the frontend's work on the last step's
        outputs. With async scheduling a decode step may stay in flight: step() launches the
        next one before it collects it, and returns its outputs then (a step late)."""
        if self.runner is None:
            raise RuntimeError("this engine was shut down; make a new one")
        outputs = EngineCoreOutputs()
        if self.overlap.in_flight is not None:
            if not self._pending:
                return self.overlap.step_ahead(outputs, during)
            self._collect(self.overlap.take(), outputs, during)  # commands see its outputs
            during = None
        self._apply_pending(outputs)
        if self.structured_output.has_waiting:
            self._admit_constrained(outputs)
        if self.structured_output.has_matchers:
            self.structured_output.release()  # the completions finished or aborted since
        stamps = [time.perf_counter()]
        k = self._choose_num_spec_tokens()
        out = self.scheduler.schedule(
            k, self.drafter.propose(self.scheduler, self.input_batch, k)
            if k and self.drafter else None,
            prefill_drafts=self.speculation is None or self.speculation.drafts_pay)
        if out.is_empty:
            self._apply_changes(out)
            if during is not None:
                during()
            elif self.structured_output.has_waiting and outputs.empty:  # grammars compiling
                self.structured_output.wait(timeout=0.05)
            return outputs
        policies = self._schedule_policies(out)
        stamps.append(time.perf_counter())
        model_input = self._prepare(out)
        bitmask = self._bitmask(model_input)
        stamps.append(time.perf_counter())
        launched = Launched(out, model_input, self.runner.execute_async(model_input), policies,
                            bitmask is not None, stamps)
        stamps.append(time.perf_counter())
        if self.overlap.schedules_ahead(launched):
            self.overlap.hold(launched)  # the next step() launches its successor first
            if during is not None:
                during()
            return outputs
        self._collect(launched, outputs, during)
        return outputs

    def _schedule_policies(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Let the policies of the step's requests add sample rows (n > 1 forks); returns the
        scheduled sequences (indices in out.seq_ids) of each request with a policy."""
        policies: dict[str, list[int]] = {}
        if not self.policies:
            return policies
        seqs = self.scheduler.seqs
        for i, seq_id in enumerate(out.seq_ids):
            request_id = seqs[seq_id].request_id
            if request_id in self.policies:
                policies.setdefault(request_id, []).append(i)
        for request_id, indices in policies.items():
            self.policies[request_id].schedule(out, indices)
        for parent, children in out.forks.items():
            self.requests[seqs[parent].request_id] += [seqs[child] for child in children]
        return policies

    def _prepare(self, out: SchedulerOutput) -> ModelInput:
        """The step's input, from the persistent batch."""
        return self.input_batch.prepare(out, self.scheduler.seqs, self.block_manager.tables)

    def _apply_changes(self, out: SchedulerOutput) -> None:
        """What changed, into the persistent batch, for a step that runs nothing."""
        self.input_batch.apply(out, self.scheduler.seqs, self.block_manager.tables)

    def _bitmask(self, model_input: ModelInput) -> Any:
        """The grammars' allowed tokens of the step's rows, into model_input (None: no row
        has a grammar)."""
        if not self.structured_output.has_matchers:
            return None
        seqs = self.scheduler.seqs
        bitmask = self.structured_output.bitmask([seqs[i] for i in model_input.seq_ids])
        if bitmask is not None:  # the rows filled ahead meanwhile, copied in
            model_input.set_token_bitmask(bitmask)
            self.structured_output.finish_bitmask(model_input.token_bitmask)
        return bitmask

    def _collect(self, launched: Launched, outputs: EngineCoreOutputs,
                 during: Callable[[], Any] | None) -> None:
        """Wait for a launched step (running during() meanwhile), advance the scheduler and
        the batch by its tokens, and put its outputs into `outputs`."""
        out, model_input = launched.out, launched.model_input
        stamps = launched.stamps[:4]
        during_seconds = 0.0
        if during is not None:  # the frontend's time, not this step's: the stamps move back
            start = time.perf_counter()
            during()
            during_seconds = time.perf_counter() - start
        model_output = launched.wait()
        stamps.append(time.perf_counter() - during_seconds)
        seqs = self.scheduler.seqs
        sampled = SampledTokens.from_array(model_output.seq_ids, model_output.sampled_token_ids)
        if launched.constrained:  # each row cut at a token its grammar forbids
            for seq in self.structured_output.accept(seqs, sampled, model_input.num_spec_tokens):
                self.scheduler.mark_changed(seq)
        ahead = self.overlap.in_flight  # launched after this one (async scheduling)
        touched = self.scheduler.update(out, sampled, None if ahead is None else ahead.out)
        self.input_batch.append_sampled(sampled, model_input)
        if self.shadow_drafts is not None and not self.speculation.drafts_pay:
            self.shadow_drafts.step(self.scheduler, self.input_batch, self.speculation)
        if launched.constrained:
            for seq in self.structured_output.stopped(touched):
                self.scheduler.finish(seq, "stop")  # its grammar is complete
            if self.runner.idle_cores_between_steps:  # the next step's rows, meanwhile
                self.structured_output.fill_ahead(touched)
        stamps.append(time.perf_counter() - during_seconds)
        self._emit(touched, model_output, outputs)
        if launched.policies:
            self._update_policies(launched.policies, model_output, outputs)
        if self.structured_output.has_matchers:
            self.structured_output.release()  # the completions that finished
        stamps.append(time.perf_counter() - during_seconds)
        self.step_timings.record(stamps)
        if self.speculation is not None:  # with the period since the last step's outputs
            now = time.perf_counter()  # (the frontend's time in between is not the step's)
            last, self._last_output_time = self._last_output_time, now
            self.speculation.observe(out, sampled,
                                     None if last is None else now - last - during_seconds,
                                     shape_k=model_input.layout.num_spec_tokens,
                                     launched_ahead=out.input_rows is not None)
        if not self.scheduler.has_unfinished():  # the last rows free now, not at the next step
            self._apply_changes(self.scheduler.take_changes())
            self._last_output_time = None  # idle next: the next period is no step's

    # ---- outputs -----------------------------------------------------------------------------

    def _emit(self, touched: list[Sequence], model_output: ModelOutput,
              outputs: EngineCoreOutputs) -> None:
        """The new tokens of the touched completions whose request wants them now: every step
        (streams, stop strings, logprobs), or when it finishes."""
        if model_output.prompt_logprobs is not None:
            self._emit_prompt_logprobs(model_output, outputs)
        due = [seq for seq in touched if seq.outputs_every_step or seq.is_finished]
        if not due:
            return
        rows = None
        if model_output.top_logprob_ids is not None or any(
                seq.sampling_params.logprobs is not None for seq in due):
            rows = {seq_id: r for r, seq_id in enumerate(model_output.seq_ids)}
        for seq in due:
            row = None if rows is None or seq.sampling_params.logprobs is None else rows[
                seq.seq_id]
            outputs.outputs.append(self._seq_output(seq, model_output, row))
            if seq.is_finished:
                self._forget(seq)

    def _seq_output(self, seq: Sequence, model_output: ModelOutput | None = None,
                    row: int | None = None) -> SeqOutput:
        """seq's tokens not sent yet (with their logprobs from this step's row, if any)."""
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_output_tokens_sent :]
        seq.num_output_tokens_sent += len(new)
        logprobs = None
        if row is not None and new:
            logprobs = _logprobs(model_output, row, len(new), seq.sampling_params.logprobs)
        return SeqOutput(seq.request_id, seq.index, new, seq.finish_reason, seq.stop_reason,
                         seq.num_cached_tokens, logprobs)

    def _emit_prompt_logprobs(self, model_output: ModelOutput,
                              outputs: EngineCoreOutputs) -> None:
        prompt, seqs, first = model_output.prompt_logprobs, self.scheduler.seqs, 0
        for seq_id, first_position, count in prompt.rows:
            seq, rows = seqs.get(seq_id), slice(first, first + count)
            first += count
            if seq is None:
                continue
            num_top = seq.sampling_params.prompt_logprobs
            outputs.prompt_logprobs.append(PromptLogprobs(
                seq.request_id, first_position, prompt.logprobs[rows].tolist(),
                prompt.ranks[rows].tolist(), prompt.top_ids[rows, :num_top].tolist(),
                prompt.top_logprobs[rows, :num_top].tolist()))

    def _admit_constrained(self, outputs: EngineCoreOutputs) -> None:
        """Schedule the constrained requests whose grammar is compiled now; abort those whose
        grammar failed (their final outputs)."""
        ready, failed = self.structured_output.take_ready()
        for seq in ready:
            self.scheduler.add_sequence(seq)
        for seq, error in failed:
            logger.error("request %s: its structured output grammar failed (%s); aborted",
                         seq.request_id, error)
            self._abort(seq.request_id, outputs)

    def _update_policies(self, policies: dict[str, list[int]], model_output: ModelOutput,
                         outputs: EngineCoreOutputs) -> None:
        """Let the policies of the step's requests pick tokens, fork and drop; the requests
        they end go out whole (beam search)."""
        rows = {seq_id: r for r, seq_id in enumerate(model_output.seq_ids)}
        for request_id in policies:
            policy = self.policies[request_id]
            output = policy.update(model_output, rows)
            if policy.done:
                del self.policies[request_id]
            if output is not None:
                for seq in self.requests.pop(request_id, ()):
                    self.scheduler.remove(seq)
                outputs.request_outputs.append(output)

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


def _logprobs(model_output: ModelOutput, row: int, num_tokens: int, num_top: int
              ) -> SeqLogprobs:
    """The logprobs of a row's first num_tokens tokens, with the top num_top."""
    ranks = model_output.sampled_ranks
    return SeqLogprobs(
        model_output.sampled_logprobs[row, :num_tokens].tolist(),
        None if ranks is None else ranks[row, :num_tokens].tolist(),
        model_output.top_logprob_ids[row, :num_tokens, :num_top].tolist() if num_top else
        [[] for _ in range(num_tokens)],
        model_output.top_logprobs[row, :num_tokens, :num_top].tolist() if num_top else
        [[] for _ in range(num_tokens)])
