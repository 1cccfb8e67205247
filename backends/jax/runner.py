"""JAX model runner: owns the params and KV caches (target and draft), one compiled step per
step shape, all compiled before the first request.

Each step uploads two arrays (the packed int32 and float32 buffers of ModelInput; two more when
a row has logit entries, one more when a row has a grammar's token bitmask) and calls the step's
executable, with the KV caches donated. With a draft model that executable also runs the draft
catch-up, the k - 1 draft steps, the target's verification pass and rejection sampling (the
step body: step.py): one device call per step. `compile` builds the engine's whole closed set
of shapes (step_shapes.py) ahead of time, XLA compiling in parallel threads; a shape met later
still compiles, but is counted and logged as the bug it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from pagedjax.backends.jax.attention import resolve_attention
from pagedjax.backends.jax.executable_store import ExecutableStore, load_copy
from pagedjax.backends.jax.model import KVCache
from pagedjax.backends.jax.parallel import REPLICATED, make_mesh
from pagedjax.backends.jax.params import DeviceModel
from pagedjax.backends.jax.step import FULL, PLAIN, StepBody, copy_blocks, decode_shaped
from pagedjax.cache import compile_at_startup
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import (
    ModelInput,
    ModelOutput,
    StepFlags,
    StepOutput,
    bitmask_width,
    buffer_sizes,
)
from pagedjax.core.kv_cache import num_kv_blocks_for_budget, warm_up_input
from pagedjax.core.model_runner import auto_dtype
from pagedjax.core.step_shapes import BatchLayout, StepShapes
from pagedjax.distributed.tensor_parallel import TensorParallelPlan
from pagedjax.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

def _branch_free_decode(platform: str) -> bool:
    """Whether decode-shaped steps run branch-free (PLAIN, FULL): on accelerators (a CPU's
    conditionals cost nothing, and what FULL runs over masks would)."""
    return platform != "cpu"


def _measures_memory(device: jax.Device) -> bool:
    """Whether the KV pool is sized from the device's memory after a trial step (accelerators)
    rather than from the host budget (CPU)."""
    return device.platform != "cpu"


class JaxModelRunner:
    """Executes ModelInputs; returns sampled token ids and logprobs (nothing else leaves)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 draft_model_config: ModelConfig | None, shapes: StepShapes) -> None:
        self.config, self.shapes = config, shapes
        self.attention_impl = resolve_attention(config.attention_impl).name
        size = config.tensor_parallel_size
        self.mesh = make_mesh(size)
        self.target = DeviceModel.load(config.model, model_config, config,
                                  TensorParallelPlan.for_model(model_config, size), self.mesh)
        self.draft = None
        if draft_model_config is not None:
            plan = TensorParallelPlan.for_draft(
                draft_model_config, size,
                config.speculative_config.draft_tensor_parallel_size)
            self.draft = DeviceModel.load(config.speculative_config.model, draft_model_config,
                                     config, plan, self.mesh)
        # Host inputs go to every device whole (replicated) or to the one device.
        self._inputs = (NamedSharding(self.mesh, REPLICATED) if self.mesh is not None
                        else SingleDeviceSharding(jax.devices()[0]))
        self._on_cpu = jax.devices()[0].platform == "cpu"
        # A call enqueues the step and reading its outputs waits for it, so the engine works
        # meanwhile: it schedules and launches the next decode step (async scheduling) and
        # builds the last step's outputs. On an accelerator (H200, batch 64: 4.16 against 4.82
        # ms a step) and on a CPU too, where XLA's threads compute while Python waits: 2-core
        # CPU, demo target, output tok/s 1.17-1.24x at batch 16-64 (RESULTS.md, stop 43).
        self.async_launch = True
        # Each step also returns the first sampled token of each row [R] (R = the most rows);
        # the next step may take its inputs from it (ModelInput's input_rows) on the device.
        self.async_scheduling = True
        # XLA's CPU threads do not spin on between steps: another core is free for the next
        # step's grammar masks (structured outputs at batch 32: 1.02x against 1.09x without).
        self.idle_cores_between_steps = True
        # [3, R] (spec_step.carry): with a draft model, speculative steps launch ahead too
        self._last_tokens = self._put(np.zeros((3, shapes.max_num_seqs), np.int32))
        self.async_speculation = True
        # On an accelerator decode steps alternate between two copies of their executable.
        # With asynchronous output processing a step's outputs are allocated while the last
        # step's still live, so at batch 1 their addresses alternate between two places and
        # XLA re-records the commands of a single copy's CUDA graph that write them on every
        # call (H100: 0.2-0.3 ms a step); each copy sees one place. A CPU has no graph (and
        # jax 0.10's CPU client cannot copy an executable it loaded from the store).
        self.executable_copies = 1 if self._on_cpu else 2
        self._copies: dict[Hashable, jax.stages.Compiled] = {}
        self._num_launches = 0
        # The caches, the last step's first tokens and a decode-shaped step's output buffers
        # are donated: each output takes its input's buffer, so the addresses a GPU step's
        # command buffer records stay put (XLA re-records every command that touches a buffer
        # whose address changed: 0.2-0.3 ms a call; at batch 64 the outputs took 7-18 places
        # over 50 calls, H100/H200). Outputs go into two sets of buffers taken in turn (the
        # last step's are still to be read when the next one launches), matched to the two
        # executable copies: each copy's graph sees one set.
        body = StepBody(self.target, self.draft, shapes.max_num_seqs,
                        None if self.mesh is None else self._inputs, config.block_size)
        self._step = jax.jit(body, donate_argnums=(2, 3, 9, 10),
                             static_argnames=("layout", "variant"))
        self._num_calls = 0
        # (layout, call parity) -> the StepOutput of its last call, donated to its next one
        self._out_buffers: dict[tuple[BatchLayout, int], StepOutput] = {}
        self._unread: set[int] = set()  # ids of the StepOutputs launched and not read yet
        self._branch_free = _branch_free_decode(jax.devices()[0].platform)
        self._copy = jax.jit(copy_blocks, donate_argnums=(0,))
        # by BatchLayout, (BatchLayout, PLAIN or FULL) or "copy"
        self._executables: dict[Hashable, jax.stages.Compiled] = {}
        self.num_compiles = 0  # step shapes compiled after `compile`: each one a logged bug
        self._late_compiles_expected = not compile_at_startup()  # unless startup compiled none
        # The logit entries of a step that has none: rows -1 (padding), kept on the device.
        entries = shapes.num_logit_entries
        self._no_entries = self._put((np.full((4, entries), -1, np.int32),
                                      np.zeros(entries, np.float32)))
        # The token bitmask [S, W] of a step without structured outputs, per sequence bucket:
        # every token allowed (FULL steps apply it; the others skip it).
        width = bitmask_width(model_config.vocab_size)
        self._no_bitmask = {s: self._put(np.full((s, width), -1, np.int32))
                            for s in shapes.seq_buckets}
        self.kv_caches: list[KVCache] = []
        self.draft_kv_caches: list[KVCache] = []
        self.num_kv_blocks = config.num_gpu_blocks_override or self._blocks_from_memory()
        self._allocate_kv_caches(self.num_kv_blocks)
        devices = (list(self.mesh.devices.flat) if self.mesh is not None
                   else [jax.devices()[0]])
        self._store = ExecutableStore(self._description(), devices)

    def _description(self) -> str:
        """What the compiled steps depend on besides a layout (ExecutableStore's key)."""
        def spec(x: jax.Array) -> tuple:
            return x.shape, str(x.dtype), str(x.sharding)

        models = [(m.config, str(m.module.dtype), m.module.packed, m.plan, m.module.kv_cache_scales)
                  for m in (self.target, self.draft) if m is not None]
        arrays = jax.tree.map(spec, ([m.params for m in (self.target, self.draft) if m],
                                     self.kv_caches, self.draft_kv_caches))
        return repr((models, self.attention_impl, self.config.block_size,
                     self.config.max_model_len, self.shapes, arrays))

    @staticmethod
    def default_dtype(model_config: ModelConfig) -> str:
        return auto_dtype(model_config, jax.default_backend() != "cpu")

    @staticmethod
    def min_decode_rows() -> int:
        """16 on a GPU: XLA emits a product of one row as multiply and reduce kernels (1.86 ms
        of kernels a 1B batch-1 step, against 1.3 ms at 16 rows) and a step with more kernels
        costs more to dispatch (H200: 1.71 ms at batch 1, 1.15 ms at 16; RESULTS.md)."""
        return 1 if jax.default_backend() == "cpu" else 16

    def _allocate_kv_caches(self, num_blocks: int) -> None:
        block_size, mesh = self.config.block_size, self.mesh
        self.kv_caches = self.target.allocate_kv_caches(num_blocks, block_size, mesh)
        self.draft_kv_caches = ([] if self.draft is None
                                else self.draft.allocate_kv_caches(num_blocks, block_size, mesh))

    def _blocks_from_memory(self) -> int:
        """On an accelerator: what gpu_memory_utilization leaves after the weights and the peak of
        the heaviest step (run once on throwaway caches)."""
        device = jax.devices()[0]
        stats = None
        if _measures_memory(device):
            model_input = warm_up_input(self.config, self.shapes)
            self._allocate_kv_caches(int(model_input.fields()["block_tables"].max()) + 1)
            # compiled for these throwaway caches' shapes: kept by neither cache
            executable = self._lower(model_input.layout).compile()
            self._host_output(model_input, self.launch(executable, model_input))
            self.kv_caches, self.draft_kv_caches = [], []
            memory = device.memory_stats()
            if memory:  # else the default budget, as on a CPU
                stats = {"bytes_limit": memory["bytes_limit"],
                         "bytes_in_use": memory.get("peak_bytes_in_use", memory["bytes_in_use"])}
        per_block = sum(m.kv_bytes_per_block(self.config.block_size,
                                               self.config.kv_cache_dtype_bytes)
                        for m in (self.target, self.draft) if m is not None)
        return num_kv_blocks_for_budget(per_block, self.config, stats)

    def shutdown(self) -> None:
        """Delete every device array now (weights, caches) rather than when garbage is
        collected, and drop the compiled steps."""
        models = [m for m in (self.target, self.draft) if m is not None]
        for array in jax.tree.leaves(([m.params for m in models], [m.rope for m in models],
                                      self.kv_caches, self.draft_kv_caches, self._no_entries,
                                      self._no_bitmask, self._last_tokens,
                                      list(self._out_buffers.values()))):
            array.delete()
        self._out_buffers.clear()
        self.kv_caches, self.draft_kv_caches, self.target, self.draft = [], [], None, None
        self._step = self._copy = None
        self._executables.clear()
        self._copies.clear()

    # ---- compile -----------------------------------------------------------------------------

    def compile_plan(self, layouts: list[BatchLayout]) -> list[Hashable]:
        """What `compile` builds: the steps of the layouts (on an accelerator each decode-shaped
        one as FULL, and each decode one as PLAIN too) and the copy-on-write copy ("copy"), less
        what is built."""
        keys: list[Hashable] = []
        for layout in layouts:
            if not (self._branch_free and decode_shaped(layout)):
                keys.append(layout)
                continue
            keys += [(layout, FULL), (layout, PLAIN)] if layout.decode else [(layout, FULL)]
        return [key for key in [*keys, "copy"] if key not in self._executables]

    def compile(self, layouts: list[BatchLayout],
                on_compiled: Callable[[], None] = lambda: None) -> None:
        """Build compile_plan(layouts) ahead of time: each step loaded from the executable
        store where it was compiled before, else traced here one after the other and compiled
        by XLA on a thread per core (and stored); on_compiled() runs after each one."""
        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            plan = self.compile_plan(layouts)
            loaded = dict(zip(plan, pool.map(self._store.load, plan)))
            for key, executable in loaded.items():
                if executable is not None:
                    self._executables[key] = executable
                    on_compiled()
            futures = {pool.submit(self._lower(key).compile): key
                       for key, executable in loaded.items() if executable is None}
            for future in as_completed(futures):
                key = futures[future]
                self._executables[key] = future.result()
                self._store.save(key, self._executables[key])
                on_compiled()
        if self.executable_copies == 2:  # each decode step's second copy, before serving
            for key in list(self._executables):
                layout = key[0] if isinstance(key, tuple) else key
                if isinstance(layout, BatchLayout) and layout.decode:
                    self._copy_of(key)

    @property
    def num_cache_hits(self) -> int:
        """Steps loaded from the executable store instead of compiled."""
        return self._store.hits

    def cache_key(self) -> str:
        return f"jax:{self._store.key}"

    def _lower(self, key: Hashable) -> jax.stages.Lowered:
        """The step of a layout or (layout, variant) (or "copy": the block copies) traced for
        the arrays it takes."""
        if key == "copy":
            caches = jax.tree.map(_spec, (self.kv_caches, self.draft_kv_caches))
            return self._copy.lower(caches, self._input_spec((self.shapes.max_num_seqs, 2)))
        args, kwargs = self._step_args(key)
        return self._step.lower(*args, **kwargs)

    def _step_args(self, key: Hashable) -> tuple[tuple, dict]:
        """The step's arguments (as ShapeDtypeStructs) and static arguments for a key."""
        layout, variant = key if isinstance(key, tuple) else (key, None)
        int_size, float_size = buffer_sizes(layout)
        args = (*jax.tree.map(_spec, (self.target.params,
                                      None if self.draft is None else self.draft.params,
                                      self.kv_caches, self.draft_kv_caches)),
                self._input_spec((int_size,)), self._input_spec((float_size,), jnp.float32),
                *jax.tree.map(_spec, self._no_entries), _spec(self._no_bitmask[layout.num_seqs]),
                self._input_spec((3, self.shapes.max_num_seqs)), self._output_spec(layout))
        return args, {"layout": layout, "variant": variant}

    def _output_spec(self, layout: BatchLayout) -> StepOutput | None:
        """The StepOutput a decode-shaped step writes, as ShapeDtypeStructs: the buffers it is
        given to write into (L = S rows of K + 1 positions; the prompt fields over its T tokens,
        zeros); None where outputs are not donated (other steps, and under tensor parallelism,
        where XLA picks the outputs' sharding)."""
        if not decode_shaped(layout) or self.mesh is not None:
            return None
        rows, t, n = (layout.num_seqs, layout.num_spec_tokens + 1), layout.num_tokens, MAX_LOGPROBS
        i32, f32 = jnp.int32, jnp.float32
        shapes = ((rows, i32), (rows, f32), ((*rows, n), i32), ((*rows, n), f32), (rows, i32),
                  ((t,), f32), ((t, n), i32), ((t, n), f32), ((t,), i32))
        return StepOutput(*(self._input_spec(shape, dtype) for shape, dtype in shapes))

    def _input_spec(self, shape: tuple[int, ...], dtype=jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._inputs)

    def executable(self, key: Hashable) -> jax.stages.Compiled:
        """The compiled step of a key (`step_key`); one outside what `compile` built is loaded
        from the executable store or compiled (and stored) now, logged and counted."""
        executable = self._executables.get(key)
        if executable is None:
            self.num_compiles += 1
            if self._late_compiles_expected:
                logger.info("compiling a step shape on first use (%s)", key)
            else:
                logger.warning("compiling a step shape after startup (%s): the closed set of "
                               "step_shapes.py missed it", key)
            executable = self._store.load(key)
            if executable is None:
                executable = self._lower(key).compile()
                self._store.save(key, executable)
            self._executables[key] = executable
        return executable

    def step_key(self, model_input: ModelInput) -> Hashable:
        """The executable a step runs: its layout's, or on an accelerator a decode-shaped
        layout's PLAIN variant when no row uses an optional sampling feature, else its FULL."""
        layout = model_input.layout
        if not (self._branch_free and decode_shaped(layout)):
            return layout
        return layout, PLAIN if layout.decode and model_input.flags == StepFlags() else FULL

    def _put(self, arrays):
        """Host arrays (any pytree) onto the device(s) the steps read them from."""
        return jax.device_put(arrays, self._inputs)

    # ---- execute -----------------------------------------------------------------------------

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Run one step (see the module docstring)."""
        return self.execute_async(model_input)()

    def execute_async(self, model_input: ModelInput) -> Callable[[], ModelOutput]:
        """Enqueue one step; the function returned waits for its outputs on the host."""
        if len(model_input.block_copies):
            self._copy_blocks(model_input.block_copies)
        key = self.step_key(model_input)
        executable = self.executable(key)
        self._num_launches += 1
        if self.executable_copies == 2 and model_input.layout.decode and self._num_launches % 2:
            executable = self._copy_of(key)
        out = self.launch(executable, model_input)
        self._unread.add(id(out))
        return lambda: self._host_output(model_input, out)

    def _copy_of(self, key: Hashable) -> jax.stages.Compiled:
        """The second copy of a decode step's executable (executable_copies)."""
        if key not in self._copies:
            self._copies[key] = load_copy(self.executable(key), self._store.devices)
        return self._copies[key]

    def _host_output(self, model_input: ModelInput, out: StepOutput) -> ModelOutput:
        """A launched step's ModelOutput: the fields its flags ask for, waited for on the host."""
        host = self._to_host(out.wanted(model_input.flags))
        self._unread.discard(id(out))
        return ModelOutput.from_step(model_input, host)

    def launch(self, executable: jax.stages.Compiled, model_input: ModelInput) -> StepOutput:
        """Enqueue one step (the caches advance); its outputs stay on the device, not waited
        for. Host arrays go to the executable as they are: it places them itself, ~10x quicker
        than a jax.device_put before the call (~0.5 ms a step on a CPU)."""
        draft_params = None if self.draft is None else self.draft.params
        entries = self._no_entries
        if model_input.entries is not None:
            entries = (model_input.entries.ints, model_input.entries.bias)
        layout = model_input.layout
        bitmask = model_input.token_bitmask
        if bitmask is None:
            bitmask = self._no_bitmask[layout.num_seqs]
        parity = self._num_calls % 2
        self._num_calls += 1
        buffers = self._out_buffers.get((layout, parity))
        if buffers is not None and id(buffers) in self._unread:  # a step still to be read
            buffers = None  # holds them (the engine reads each before the next but one)
        if buffers is None and (spec := self._output_spec(layout)) is not None:
            buffers = jax.tree.map(lambda s: self._put(np.zeros(s.shape, s.dtype)), spec)
        self.kv_caches, self.draft_kv_caches, self._last_tokens, out = executable(
            self.target.params, draft_params, self.kv_caches, self.draft_kv_caches,
            model_input.ints, model_input.floats, *entries, bitmask, self._last_tokens, buffers)
        if buffers is not None:
            self._out_buffers[layout, parity] = out
        return out

    def _to_host(self, arrays):
        """Device arrays (any pytree) as numpy: on a CPU a view of each buffer (jax.device_get's
        asynchronous copies cost ~10x more there), elsewhere one batch of copies."""
        if self._on_cpu:
            return jax.tree.map(np.asarray, arrays)
        return jax.device_get(arrays)

    def _copy_blocks(self, block_copies: np.ndarray) -> None:
        """Copy-on-write copies, padded to max_num_seqs (a sequence copies one block a step at
        most; dst past the pool: dropped) so that one executable serves every step."""
        copies = np.full((self.shapes.max_num_seqs, 2), self.num_kv_blocks, np.int32)
        copies[: len(block_copies)] = block_copies
        copies[:, 0] = np.minimum(copies[:, 0], self.num_kv_blocks - 1)
        self.kv_caches, self.draft_kv_caches = self.executable("copy")(
            (self.kv_caches, self.draft_kv_caches), copies)


def _spec(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
