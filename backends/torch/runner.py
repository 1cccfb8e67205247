"""Torch model runner: owns the models and KV caches (target and draft); one step per call.

Each step uploads the two packed buffers of ModelInput and runs the whole step on the device:
with drafts, the draft catch-up and k - 1 draft steps, the target's verification pass and
rejection sampling (the step body: step.py), with no host synchronisation until the sampled
tokens come back. The runner holds the models, caches and graphs (lifecycle only).
CPU: eager, on the C++ CPU ops. CUDA: decode and speculative-decode steps replay CUDA graphs of
the whole step (cuda_graphs.py), all captured by `compile` before the first request (the closed
set of step_shapes.py); other steps run eagerly. On CUDA a step is launched and the copies of
its outputs to the host queued; the engine waits for them when it needs them, so it builds the
last step's outputs, or schedules and launches the next step (async scheduling: rows read their
input token from the last step's, kept on the device in last_tokens), while the device runs.
The KV pool is sized from the device memory left after a warm-up of the largest step.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Callable

import torch

from pagedjax.backends.torch.cuda_graphs import HostToDevice, StepGraphs
from pagedjax.backends.torch.parallel import Shard, Workers
from pagedjax.backends.torch.params import DeviceModel
from pagedjax.backends.torch.step import StepBody, copy_blocks
from pagedjax.cache import source_digest
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import (
    ModelInput,
    ModelOutput,
    StepFlags,
    StepOutput,
    padding_input,
)
from pagedjax.core.kv_cache import num_kv_blocks_for_budget, warm_up_input
from pagedjax.core.model_runner import auto_dtype
from pagedjax.core.step_shapes import BatchLayout, StepShapes
from pagedjax.distributed.tensor_parallel import TensorParallelPlan
from pagedjax.kernels_cuda import ops_backend

# The two CUDA graphs of a decode-shaped step: greedy rows with nothing else ("plain"), or the
# whole sampler (random rows, filters, top logprobs: "full", correct for any such step because
# rows that do not use a feature are left as they are). Steps with prompt logprobs or logit
# entries run eagerly.
GRAPH_FLAGS = {"plain": StepFlags(), "full": StepFlags(sampled=True, filters=True,
                                                       logprobs=True)}


class TorchModelRunner:
    """Executes ModelInputs; returns sampled token ids and logprobs (nothing else leaves).

    With tensor_parallel_size N > 1 this is rank 0 of N processes (parallel.py): it starts the
    others, broadcasts every step to them and runs its own shard of it.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 draft_model_config: ModelConfig | None, shapes: StepShapes, *,
                 rank: int = 0) -> None:
        self.config, self.shapes, self.rank = config, shapes, rank
        size = config.tensor_parallel_size
        if size > 1 and torch.cuda.is_available() and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} exceeds the "
                             f"{torch.cuda.device_count()} GPU(s) present.")
        self.workers = (Workers((config, model_config, draft_model_config, shapes), size)
                        if size > 1 and rank == 0 else None)
        self.device = (torch.device("cuda", rank) if torch.cuda.is_available()
                       else torch.device("cpu"))
        # (free, total) device bytes before this runner took any: what others hold is theirs
        self._memory_before = (torch.cuda.mem_get_info(self.device)
                               if self.device.type == "cuda" else None)
        target = Shard(rank, TensorParallelPlan.for_model(model_config, size))
        self.models = [DeviceModel.load(config.model, model_config, config, self.device, target)]
        if draft_model_config is not None:
            draft = Shard(rank, TensorParallelPlan.for_draft(
                draft_model_config, size,
                config.speculative_config.draft_tensor_parallel_size))
            self.models.append(DeviceModel.load(config.speculative_config.model,
                                           draft_model_config, config, self.device, draft))
        self.upload = HostToDevice(self.device)
        # what the last step leaves the next (spec_step.keep_carry) [3, max_num_seqs]: each
        # row's last sampled token, the inputs of the rows whose input_rows say so (async
        # scheduling), and for a speculative step launched ahead, the drafts accepted; one
        # buffer, so graphs capture it
        self.last_tokens = torch.zeros(3, shapes.max_num_seqs, dtype=torch.int32,
                                       device=self.device)
        self.last_tokens[1] = -1
        # On CUDA a step runs while the host goes on (its graph replays, its outputs' copies to
        # the host are queued, and only the function execute_async returns waits for them).
        # On a CPU torch computes as it is called: nothing to overlap.
        self.step = StepBody(self.models, self.last_tokens,
                             async_launch=self.device.type == "cuda",
                             block_size=config.block_size)
        self.graphs: StepGraphs | None = None  # none while the pool is sized
        self.num_kv_blocks = 0
        if rank == 0:  # rank 0 sizes the pool; the others allocate when told to
            self.allocate_kv_caches(config.num_gpu_blocks_override or self._blocks_from_memory())
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = StepGraphs(self.device)

    @staticmethod
    def default_dtype(model_config: ModelConfig) -> str:
        return auto_dtype(model_config, torch.cuda.is_available())

    @staticmethod
    def min_decode_rows() -> int:
        return 1  # cuBLAS reads the weights of a one-row product at the floor (RESULTS.md)

    @property
    def num_compiles(self) -> int:
        """CUDA graphs captured after `compile` (each one a logged bug); 0 on CPU (eager)."""
        return 0 if self.graphs is None else self.graphs.num_late_captures

    @property
    def num_cache_hits(self) -> int:
        """CUDA graphs are captured in every process: none come from a cache."""
        return 0

    def cache_key(self) -> str:
        device = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                  else f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}")
        models = [(m.config, str(m.module.norm.weight.dtype), m.shard) for m in self.models]
        return repr(("torch", torch.__version__, device, ops_backend(), source_digest(),
                     models, self.num_kv_blocks, self.config.enforce_eager))

    @staticmethod
    def graph_plan(layouts: list[BatchLayout]) -> list[tuple[BatchLayout, str]]:
        """The CUDA graphs of the closed set: both variants (GRAPH_FLAGS) of every decode and
        speculative decode shape; mixed steps run eagerly."""
        return [(layout, variant) for layout in layouts
                if layout.decode or layout.num_spec_tokens for variant in GRAPH_FLAGS]

    def compile_plan(self, layouts: list[BatchLayout]) -> list[tuple[BatchLayout, str]]:
        """What `compile` captures: graph_plan(layouts) on CUDA; nothing on CPU or with
        enforce_eager (eager steps compile nothing)."""
        return [] if self.graphs is None else self.graph_plan(layouts)

    @torch.inference_mode()  # as _launch: the graphs share its staging buffers
    def compile(self, layouts: list[BatchLayout],
                on_compiled: Callable[[], None] = lambda: None) -> None:
        """Capture the CUDA graph of every decode-shaped step before the first request (on a
        step of padding: it writes no KV)."""
        for layout, variant in self.compile_plan(layouts):
            model_input = padding_input(layout, GRAPH_FLAGS[variant])
            self.graphs.capture((layout, variant), self._graph_step(layout, variant),
                                model_input.ints, model_input.floats, self.upload)
            on_compiled()

    def allocate_kv_caches(self, num_blocks: int) -> None:
        """The KV pool of num_blocks blocks, on every rank."""
        if self.workers is not None:
            self.workers.send("allocate_kv_caches", num_blocks)
        self.num_kv_blocks = num_blocks
        for model in self.models:
            model.allocate_kv_caches(num_blocks, self.config.block_size)

    def _blocks_from_memory(self) -> int:
        stats = self._cuda_memory_after_warm_up() if self.device.type == "cuda" else None
        per_block = sum(m.kv_bytes_per_block(self.config.block_size,
                                               self.config.kv_cache_dtype_bytes)
                        for m in self.models)
        return num_kv_blocks_for_budget(per_block, self.config, stats)

    def _cuda_memory_after_warm_up(self) -> dict[str, int]:
        """{"bytes_limit", "bytes_in_use", "bytes_free"}: this engine's own use (weights, the
        largest step's activation peak, and what outside torch's allocator grew since the
        runner started), vLLM's per-instance rule: two engines at 0.4 share a device, whatever
        else it holds, as long as it is free (KV pool at most the free bytes).

        CUDA graphs captured later take their own (decode-sized) pool out of the
        1 - gpu_memory_utilization headroom.
        """
        torch.cuda.reset_peak_memory_stats()
        model_input = warm_up_input(self.config, self.shapes)
        self.allocate_kv_caches(int(model_input.fields()["block_tables"].max()) + 1)
        self.execute(model_input)
        self.allocate_kv_caches(0)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        free_before, _ = self._memory_before
        # device bytes taken since the start outside torch's allocator (our context, cuBLAS)
        outside_torch = max(free_before - free - torch.cuda.memory_reserved(), 0)
        return {"bytes_limit": total, "bytes_free": free,
                "bytes_in_use": torch.cuda.max_memory_allocated() + outside_torch}

    def shutdown(self) -> None:
        """Stop the other ranks, drop the models, caches and graphs, and return the cached CUDA
        memory."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        self.models, self.graphs, self.upload, self.step = [], None, None, None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    # ---- execute -----------------------------------------------------------------------------

    async_scheduling = True  # a step's rows read their input_rows from last_tokens

    @property
    def async_speculation(self) -> bool | None:
        """Where steps launch asynchronously (CUDA), a draft model's speculative steps may too
        (spec_step.shift_ahead), off unless PAGEDJAX_ASYNC_SPECULATION=1 until a GPU has run
        them (ModelRunner.async_speculation)."""
        return None if self.async_launch else False

    @property
    def async_launch(self) -> bool:
        """Whether a step is launched and its outputs waited for later (the step body then
        reads each row's input from last_tokens where input_rows says so)."""
        return self.step.async_launch

    @async_launch.setter
    def async_launch(self, on: bool) -> None:
        self.step.async_launch = on

    @property
    def idle_cores_between_steps(self) -> bool:
        """On a GPU. On a CPU, torch's OpenMP workers spin for ~5 ms after each parallel
        region (libgomp's default), through the whole host phase: a grammar's mask filled
        there waits for that core (2-core CPU, batch 32: 1.17x the unconstrained step against
        1.04x filled in the step)."""
        return self.device.type == "cuda"

    def execute_async(self, model_input: ModelInput) -> Callable[[], ModelOutput]:
        """Start one step (see the module docstring) on every rank; the function returned
        waits for its output on the host."""
        if self.workers is not None:
            self.workers.send("execute_local", model_input)
        launched = self._launch(model_input)
        return lambda: self._wait(launched, model_input)

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Run one step, on every rank."""
        return self.execute_async(model_input)()

    def execute_local(self, model_input: ModelInput) -> ModelOutput:
        """This rank's part of the step (the other ranks' loop)."""
        return self._wait(self._launch(model_input), model_input)

    @torch.inference_mode()
    def _launch(self, model_input: ModelInput) -> tuple[StepOutput, torch.cuda.Event | None]:
        """This rank's step, queued: its outputs' copies to the host (pinned tensors, not
        yet valid on CUDA) and the event after them."""
        self.upload.begin_step()
        if len(model_input.block_copies):
            copy_blocks(self.models, self.upload("block_copies", model_input.block_copies))
        variant = self._graph_variant(model_input)
        if variant is not None:
            out = self.graphs.run((model_input.layout, variant),
                                  self._graph_step(model_input.layout, variant),
                                  model_input.ints, model_input.floats, self.upload)
        else:  # eager: the padding tokens need not run (a graph replays the padded shapes)
            max_draft, num_draft = model_input.max_draft_query_len, model_input.num_draft_tokens
            if self.async_launch and model_input.layout.draft and model_input.num_spec_tokens:
                # launched ahead, the draft catches up on 2 tokens a sequence, not 1, where the
                # last step's drafts were all accepted (shift_ahead; the host cannot tell)
                max_draft, num_draft = max(max_draft, 2), min(2 * num_draft,
                                                              model_input.layout.num_tokens)
            out = self.step(self.upload("ints", model_input.ints),
                             self.upload("floats", model_input.floats),
                             self._entries(model_input), self._token_bitmask(model_input),
                             layout=model_input.layout,
                             flags=model_input.flags, max_query_len=model_input.max_query_len,
                             max_draft_query_len=max_draft,
                             num_tokens=model_input.num_tokens,
                             num_draft_tokens=num_draft,
                             num_samples=model_input.num_logits)
        # copied out now: a graph's outputs are its own buffers, overwritten by its next replay
        host = StepOutput(*(None if t is None else t.to("cpu", non_blocking=True)
                            for t in out.wanted(model_input.flags).cut(model_input)))
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.upload.end_step(done)
        return host, done

    @staticmethod
    def _wait(launched: tuple[StepOutput, torch.cuda.Event | None],
              model_input: ModelInput) -> ModelOutput:
        """A launched step's ModelOutput, once its copies to the host are done (the step's
        one synchronisation)."""
        host, done = launched
        if done is not None:
            done.synchronize()
        return ModelOutput.from_step(model_input, host)

    def _graph_variant(self, model_input: ModelInput) -> str | None:
        """The graph a step replays: decode-shaped steps without prompt logprobs, logit entries
        or a token bitmask; None: eager."""
        layout, flags = model_input.layout, model_input.flags
        if (self.graphs is None or not (layout.decode or layout.num_spec_tokens)
                or flags.prompt_logprobs or flags.logit_entries or flags.token_mask):
            return None
        return "plain" if flags == GRAPH_FLAGS["plain"] else "full"

    def _graph_step(self, layout: BatchLayout, variant: str) -> functools.partial:
        """The step a graph captures: launch bounds from the shape (a query of K + 1 tokens at
        most, and a draft catch-up as long: Scheduler._fit_drafts)."""
        k = layout.num_spec_tokens
        return functools.partial(self.step, entries=None, layout=layout,
                                 flags=GRAPH_FLAGS[variant], max_query_len=k + 1,
                                 max_draft_query_len=k + 1)

    def _entries(self, model_input: ModelInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's real logit entries on the device (no padding: an eager step)."""
        entries = model_input.entries
        if entries is None:
            return None
        n = entries.num_entries
        return (self.upload("entry_ints", entries.ints[:, :n]),
                self.upload("entry_bias", entries.bias[:n]))

    def _token_bitmask(self, model_input: ModelInput) -> torch.Tensor | None:
        """The step's token bitmask [S, W] on the device, if a row has structured outputs."""
        bitmask = model_input.token_bitmask
        return None if bitmask is None else self.upload("token_bitmask", bitmask)

