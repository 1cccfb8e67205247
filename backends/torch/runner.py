"""Torch model runner: owns the models and KV caches (target and draft); one step per call.

Each step uploads the two packed buffers of ModelInput and runs the whole step on the device:
with drafts, the draft catch-up and k - 1 draft steps (spec_step.py), the target's verification
pass and rejection sampling, with no host synchronisation until the sampled tokens come back.
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
from dataclasses import dataclass

import torch

from pagedjax.backends.rope import rope_cos_sin
from pagedjax.backends.torch.cuda_graphs import HostToDevice, StepGraphs
from pagedjax.backends.torch.model import (
    AttentionMetadata,
    KVCache,
    LayerOps,
    LlamaForCausalLM,
    load_model,
)
from pagedjax.backends.torch.parallel import Shard, Workers
from pagedjax.backends.torch.rejection_sampler import rejection_sample
from pagedjax.backends.torch.sampler import gather_logprobs, sample, score_prompt_tokens
from pagedjax.backends.torch.spec_step import propose_drafts
from pagedjax.cache import source_digest
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import (
    SAMPLING_FIELDS,
    ModelInput,
    ModelOutput,
    StepFlags,
    StepOutput,
    padding_input,
    unpack,
)
from pagedjax.core.kv_cache import num_kv_blocks_for_budget, warm_up_input
from pagedjax.core.model_runner import auto_dtype
from pagedjax.core.step_shapes import BatchLayout, StepShapes
from pagedjax.kernels_cuda import (
    ops_backend,
    ragged_paged_attention,
    reference,
    rotary_embedding_,
    write_kv,
)
from pagedjax.parallel import TensorParallelPlan
from pagedjax.sampling_params import MAX_LOGPROBS

ATTENTION_IMPLS = ("auto", "reference")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The two CUDA graphs of a decode-shaped step: greedy rows with nothing else ("plain"), or the
# whole sampler (random rows, filters, top logprobs: "full", correct for any such step because
# rows that do not use a feature are left as they are). Steps with prompt logprobs or logit
# entries run eagerly.
GRAPH_FLAGS = {"plain": StepFlags(), "full": StepFlags(sampled=True, filters=True,
                                                       logprobs=True)}


def resolve_attention(attention_impl: str) -> LayerOps:
    """"auto": the pagedjax custom ops (CUDA, C++ CPU); "reference": their pure-torch reference."""
    if attention_impl == "auto":
        return LayerOps(ragged_paged_attention, write_kv, rotary_embedding_)
    if attention_impl == "reference":
        return LayerOps(_reference_attention, reference.write_kv, reference.rotary_embedding_)
    raise ValueError(f"attention_impl={attention_impl!r} is not available on the torch backend; "
                     f"use one of {ATTENTION_IMPLS}.")


def uses_cpu_linear(attention_impl: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the projections run on the packed C++ `pagedjax::linear` op: CPU, float32, the
    custom ops built and chosen (attention_impl "auto")."""
    return (attention_impl == "auto" and device.type == "cpu" and dtype == torch.float32
            and ops_backend() != "reference")


def _reference_attention(*args, max_query_len: int | None = None, **kwargs) -> torch.Tensor:
    """The reference reads the metadata on the host: it needs no launch hint."""
    del max_query_len
    return reference.ragged_paged_attention(*args, **kwargs)


@dataclass
class _Model:
    """One model on this rank's device: its shard, rope tables and KV caches."""

    module: LlamaForCausalLM
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [max_model_len, D]
    config: ModelConfig  # as the devices hold it (KV heads repeated under tensor parallelism)
    shard: Shard
    kv_caches: list[KVCache]  # views of kv_pool: (K, V) per layer, [N, Hkv, bs, D] each
    kv_pool: torch.Tensor | None = None  # [num_layers, 2, N, Hkv, bs, D]

    @classmethod
    def load(cls, model_dir: str, model_config: ModelConfig, config: EngineConfig,
             device: torch.device, shard: Shard) -> _Model:
        shard_config = shard.plan.shard_config(model_config)
        dtype = _DTYPES[config.dtype]
        module = load_model(model_dir, shard_config, dtype, device,
                            resolve_attention(config.attention_impl), shard=shard)
        if uses_cpu_linear(config.attention_impl, device, dtype):
            module.pack_linears()
        cos, sin = rope_cos_sin(model_config, config.max_model_len)  # [max_model_len, D] each
        rope = (torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device))
        return cls(module, rope, shard_config, shard, [])

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        """Zeroed caches for this rank's KV heads: one pool, so that a copy-on-write is one
        gather and one scatter for every layer at once."""
        cfg, weight = self.config, self.module.norm.weight
        shape = (num_blocks, self.shard.part(cfg.num_kv_heads), block_size, cfg.head_dim)
        self.kv_pool = torch.zeros((cfg.num_layers, 2, *shape), dtype=weight.dtype,
                                   device=weight.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_pool]  # contiguous views

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """KV bytes of one block on this rank."""
        return self.config.kv_bytes_per_block(block_size, dtype_bytes) // self.shard.size

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, kv_caches, meta, logits_indices)


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
        self.models = [_Model.load(config.model, model_config, config, self.device, target)]
        if draft_model_config is not None:
            draft = Shard(rank, TensorParallelPlan.for_draft(
                draft_model_config, size,
                config.speculative_config.draft_tensor_parallel_size))
            self.models.append(_Model.load(config.speculative_config.model,
                                           draft_model_config, config, self.device, draft))
        self.upload = HostToDevice(self.device)
        # each row's first sampled token of the last step [max_num_seqs]: the inputs of the
        # rows whose input_rows say so (async scheduling); one buffer, so graphs capture it
        self.last_tokens = torch.zeros(shapes.max_num_seqs, dtype=torch.int32,
                                       device=self.device)
        # On CUDA a step runs while the host goes on (its graph replays, its outputs' copies to
        # the host are queued, and only the function execute_async returns waits for them).
        # On a CPU torch computes as it is called: nothing to overlap.
        self.async_launch = self.device.type == "cuda"
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
        per_block = sum(m.kv_bytes_per_block(self.config.block_size, self.config.dtype_bytes)
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
        self.models, self.graphs, self.upload = [], None, None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    # ---- execute -----------------------------------------------------------------------------

    async_scheduling = True  # a step's rows read their input_rows from last_tokens

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
            self._copy_blocks(self.upload("block_copies", model_input.block_copies))
        variant = self._graph_variant(model_input)
        if variant is not None:
            out = self.graphs.run((model_input.layout, variant),
                                  self._graph_step(model_input.layout, variant),
                                  model_input.ints, model_input.floats, self.upload)
        else:  # eager: the padding tokens need not run (a graph replays the padded shapes)
            out = self._step(self.upload("ints", model_input.ints),
                             self.upload("floats", model_input.floats),
                             self._entries(model_input), self._token_bitmask(model_input),
                             layout=model_input.layout,
                             flags=model_input.flags, max_query_len=model_input.max_query_len,
                             max_draft_query_len=model_input.max_draft_query_len,
                             num_tokens=model_input.num_tokens,
                             num_draft_tokens=model_input.num_draft_tokens,
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
        return functools.partial(self._step, entries=None, layout=layout,
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

    def _step(self, ints: torch.Tensor, floats: torch.Tensor,
              entries: tuple[torch.Tensor, torch.Tensor] | None,
              token_bitmask: torch.Tensor | None = None, *, layout: BatchLayout,
              flags: StepFlags, max_query_len: int, max_draft_query_len: int,
              num_tokens: int | None = None, num_draft_tokens: int | None = None,
              num_samples: int | None = None) -> StepOutput:
        """The whole step on the device → StepOutput: tokens and logprobs [L, K+1], and what the
        flags ask for besides. num_tokens, num_draft_tokens and num_samples: the real tokens of
        the target and of the draft's catch-up, and the real logits rows, when only those run
        (the padding rows are skipped: a speculative step of one sequence pads 5 tokens to 8;
        the padding rows' logits are zeros)."""
        num_tokens = layout.num_tokens if num_tokens is None else num_tokens
        b = unpack(layout, ints, floats)
        sampling = {name: b[name] for name in SAMPLING_FIELDS}
        for name in ("rng_seed", "rng_step"):  # uint32 counters, emulated in int64
            sampling[name] = b[name].to(torch.int64) & 0xFFFFFFFF
        if entries is not None:
            sampling["entries"] = entries
        if token_bitmask is not None:
            sampling["token_bitmask"] = token_bitmask  # [S, W]
        target, k = self.models[0], layout.num_spec_tokens
        input_ids = b["input_ids"]
        if self.async_launch:  # only then may a step be scheduled before the last one's tokens
            rows = b["input_rows"]  # [T]: 1 + a row of last_tokens, or 0 (input_ids)
            input_ids = torch.where(rows > 0, self.last_tokens[(rows - 1).clamp(min=0).long()],
                                    input_ids)
        if layout.draft:
            draft = self.models[1]
            drafts = propose_drafts(draft.forward, draft.kv_caches, b, draft.rope,
                                    layout=layout, max_query_len=max_draft_query_len,
                                    num_tokens=num_draft_tokens)
        if k:
            # Draft slots get their drafts; index T (no draft) lands in a discarded extra row.
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1)])
            input_ids[b["draft_token_index"].reshape(-1).long()] = drafts.reshape(-1)
        input_ids = input_ids[:num_tokens]
        meta = AttentionMetadata(b["positions"][:num_tokens], b["slot_mapping"][:num_tokens],
                                 b["query_start_loc"], b["kv_lens"], b["block_tables"],
                                 *target.rope, max_query_len=max_query_len)
        indices = b["logits_indices"]  # [L, K+1]
        rows = indices[: indices.shape[0] if num_samples is None else num_samples].reshape(-1)
        num_rows = rows.numel()
        if flags.prompt_logprobs:  # the prompt positions scored, after the sampled rows
            rows = torch.cat([rows, b["prompt_logprobs_indices"]])
        logits = target.forward(input_ids, target.kv_caches, meta, rows)
        prompt = ()
        if flags.prompt_logprobs:
            logits, prompt_logits = logits[:num_rows], logits[num_rows:]
            prompt = score_prompt_tokens(prompt_logits, b["prompt_logprobs_token_ids"])
        if num_rows < indices.numel():  # the padding rows: zeros
            logits = torch.nn.functional.pad(logits, (0, 0, 0, indices.numel() - num_rows))
        if not k:
            out = sample(logits, sampling, flags)
            self._keep_first_tokens(out[0][:, None])
            return StepOutput(*(None if x is None else x[:, None] for x in out), *prompt)
        logits = logits.view(*indices.shape, -1)  # [L, K+1, V]
        seqs = b["sample_seq"].long()  # [L]: the sequence whose drafts row l verifies
        tokens, _ = rejection_sample(logits, drafts[seqs], None, b["num_draft_tokens"],
                                     sampling, all_greedy=not flags.sampled,
                                     use_filters=flags.filters)
        self._keep_first_tokens(tokens)
        lse = torch.logsumexp(logits, dim=-1)  # [L, K+1]
        return StepOutput(tokens, *gather_logprobs(
            logits, lse, tokens, MAX_LOGPROBS if flags.logprobs else 0), *prompt)

    def _keep_first_tokens(self, tokens: torch.Tensor) -> None:
        """[L, K+1] → each row's first token into last_tokens (the next step's inputs, read
        on the device when it is launched before these reach the host; a CPU never is)."""
        if not self.async_launch:
            return
        n = min(tokens.shape[0], self.last_tokens.shape[0])
        self.last_tokens[:n] = tokens[:n, 0]

    def _copy_blocks(self, copies: torch.Tensor) -> None:
        """Copy-on-write: block copies[:, 1] becomes a copy of block copies[:, 0] in every layer
        of every model (target and draft)."""
        src, dst = copies[:, 0].long(), copies[:, 1].long()  # [C] each
        for model in self.models:  # the gather copies first, as the JAX .at[].set
            model.kv_pool.index_copy_(2, dst, model.kv_pool.index_select(2, src))

