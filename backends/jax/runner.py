"""JAX model runner: owns the params and KV caches (target and draft), one jitted step per batch.

Each step uploads two arrays (the packed int32 and float32 buffers of ModelInput) and calls one
jitted function, specialised on the step's BatchLayout, with the KV caches donated. With drafts
that function also runs the draft catch-up, the k - 1 draft steps (spec_step.py), the target's
verification pass and rejection sampling: one device call per step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pagedjax.backends.jax.attention import resolve_attention
from pagedjax.backends.jax.model import (
    AttentionMetadata,
    KVCache,
    LlamaForCausalLM,
    pack_params,
)
from pagedjax.backends.jax.params import load_params
from pagedjax.backends.jax.rejection_sampler import rejection_sample
from pagedjax.backends.jax.sampler import gather_logprobs, sample, score_prompt_tokens
from pagedjax.backends.jax.sharding import KV_CACHE, REPLICATED, make_mesh, per_shard
from pagedjax.backends.jax.spec_step import propose_drafts
from pagedjax.backends.rope import rope_cos_sin
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import (
    SAMPLING_FIELDS,
    BatchLayout,
    ModelInput,
    ModelOutput,
    StepOutput,
    bucket,
)
from pagedjax.core.kv_cache import num_kv_blocks_for_budget, warm_up_input
from pagedjax.core.model_runner import auto_dtype
from pagedjax.parallel import TensorParallelPlan

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def uses_cpu_linear(attention_impl: str, dtype: jnp.dtype, mesh: Mesh | None) -> bool:
    """The linear layers on the C++ kernel through XLA's FFI: with the C++ CPU attention
    ("cpu"), in float32, on one device (packed kernels have no tensor-parallel layout)."""
    if attention_impl != "cpu" or dtype != jnp.float32 or mesh is not None:
        return False
    from pagedjax.kernels_pallas import cpu_ffi

    return cpu_ffi.available()


@dataclasses.dataclass(frozen=True)
class _Model:
    """One model on the device(s): module, params, rope tables and how it is split."""

    module: LlamaForCausalLM
    params: dict
    rope: tuple[jax.Array, jax.Array]  # cos, sin: [max_model_len, D]
    config: ModelConfig  # as the devices hold it (KV heads repeated under tensor parallelism)
    plan: TensorParallelPlan
    params_source: str  # "orbax" | "safetensors"

    @classmethod
    def load(cls, model_dir: str, model_config: ModelConfig, config: EngineConfig,
             plan: TensorParallelPlan, mesh: Mesh | None) -> _Model:
        dtype = _DTYPES[config.dtype]
        attention_fn, write_kv_fn, impl = resolve_attention(config.attention_impl)
        shard_config = plan.shard_config(model_config)
        packed = uses_cpu_linear(impl, dtype, mesh)
        module = LlamaForCausalLM(shard_config, dtype,
                                  *per_shard(attention_fn, write_kv_fn, mesh, plan), packed)
        params, source = load_params(model_dir, model_config, dtype, plan=plan, mesh=mesh)
        if packed:
            params = pack_params(params, model_config.tie_word_embeddings)
        cos, sin = rope_cos_sin(model_config, config.max_model_len)
        return cls(module, params, (jnp.asarray(cos), jnp.asarray(sin)), shard_config, plan,
                   source)

    def forward(self, params: dict) -> functools.partial:
        """(input_ids, kv_caches, meta, logits_indices) -> (logits, kv_caches) with params."""
        return functools.partial(self.module.apply, params)

    def allocate_kv_caches(self, num_blocks: int, block_size: int,
                           mesh: Mesh | None) -> list[KVCache]:
        """Zeroed caches, each device holding its heads' share."""
        cfg, dtype = self.config, self.module.dtype
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        if mesh is None:
            zeros = lambda: jnp.zeros(shape, dtype)
        else:
            spec = KV_CACHE if self.plan.shard_heads else REPLICATED
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype),
                            out_shardings=NamedSharding(mesh, spec))
        return [(zeros(), zeros()) for _ in range(cfg.num_layers)]

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """KV bytes of one block on each device."""
        shards = self.plan.size if self.plan.shard_heads else 1
        return self.config.kv_bytes_per_block(block_size, dtype_bytes) // shards


class JaxModelRunner:
    """Executes ModelInputs; returns sampled token ids and logprobs (nothing else leaves)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 draft_model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.attention_impl = resolve_attention(config.attention_impl)[2]
        size = config.tensor_parallel_size
        self.mesh = make_mesh(size)
        self.target = _Model.load(config.model, model_config, config,
                                  TensorParallelPlan.for_model(model_config, size), self.mesh)
        self.draft = None
        if draft_model_config is not None:
            plan = TensorParallelPlan.for_draft(
                draft_model_config, size,
                config.speculative_config.get("draft_tensor_parallel_size"))
            self.draft = _Model.load(config.speculative_config["model"], draft_model_config,
                                     config, plan, self.mesh)
        self.num_compiles = 0  # traces of the step function: must stay bounded
        self._step = jax.jit(self._step_fn, donate_argnums=(2, 3), static_argnames=("layout",))
        self.kv_caches: list[KVCache] = []
        self.draft_kv_caches: list[KVCache] = []
        self.num_kv_blocks = config.num_gpu_blocks_override or self._blocks_from_memory()
        self._allocate_kv_caches(self.num_kv_blocks)

    @staticmethod
    def default_dtype(model_config: ModelConfig) -> str:
        return auto_dtype(model_config, jax.default_backend() != "cpu")

    def _allocate_kv_caches(self, num_blocks: int) -> None:
        block_size, mesh = self.config.block_size, self.mesh
        self.kv_caches = self.target.allocate_kv_caches(num_blocks, block_size, mesh)
        self.draft_kv_caches = ([] if self.draft is None
                                else self.draft.allocate_kv_caches(num_blocks, block_size, mesh))

    def _blocks_from_memory(self) -> int:
        """On an accelerator: what gpu_memory_utilization leaves after the weights and the peak of
        the heaviest step (run once on throwaway caches). UNVERIFIED on a GPU."""
        device = jax.devices()[0]
        stats = None
        if device.platform != "cpu":
            model_input = warm_up_input(self.config)
            self._allocate_kv_caches(int(model_input.fields()["block_tables"].max()) + 1)
            self.execute(model_input)
            self.kv_caches, self.draft_kv_caches = [], []
            memory = device.memory_stats()
            stats = {"bytes_limit": memory["bytes_limit"],
                     "bytes_in_use": memory.get("peak_bytes_in_use", memory["bytes_in_use"])}
        per_block = sum(m.kv_bytes_per_block(self.config.block_size, self.config.dtype_bytes)
                        for m in (self.target, self.draft) if m is not None)
        return num_kv_blocks_for_budget(per_block, self.config, stats)

    def shutdown(self) -> None:
        """Delete every device array now (weights, caches) rather than when garbage is
        collected, and drop the compiled steps."""
        models = [m for m in (self.target, self.draft) if m is not None]
        for array in jax.tree.leaves(([m.params for m in models], [m.rope for m in models],
                                      self.kv_caches, self.draft_kv_caches)):
            array.delete()
        self.kv_caches, self.draft_kv_caches, self.target, self.draft = [], [], None, None
        self._step = None

    # ---- execute -----------------------------------------------------------------------------

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Run one step (see the module docstring)."""
        if len(model_input.block_copies):
            # Padded to a power of two (dst past the pool: dropped), so that beams, whose
            # copy-on-write count changes every step, compile a few copy shapes only.
            copies = np.full((bucket(len(model_input.block_copies)), 2), self.num_kv_blocks,
                             np.int32)
            copies[: len(model_input.block_copies)] = model_input.block_copies
            copies[:, 0] = np.minimum(copies[:, 0], self.num_kv_blocks - 1)
            copies = jnp.asarray(copies)
            self.kv_caches, self.draft_kv_caches = _copy_blocks(
                (self.kv_caches, self.draft_kv_caches), copies)
        draft_params = None if self.draft is None else self.draft.params
        self.kv_caches, self.draft_kv_caches, out = self._step(
            self.target.params, draft_params, self.kv_caches, self.draft_kv_caches,
            jnp.asarray(model_input.ints), jnp.asarray(model_input.floats),
            layout=model_input.layout)
        return ModelOutput.from_step(model_input, jax.device_get(out))

    def _step_fn(self, params: dict, draft_params: dict | None, kv_caches: list[KVCache],
                 draft_kv_caches: list[KVCache], ints: jax.Array, floats: jax.Array, *,
                 layout: BatchLayout) -> tuple:
        """The whole step on the device → (caches, draft caches, StepOutput with tokens and
        logprobs [L, K+1], and what the layout asks for besides)."""
        self.num_compiles += 1  # runs only while tracing
        b = layout.unpack(ints, floats)
        sampling = {name: b[name] for name in SAMPLING_FIELDS if name in b}
        for name in ("rng_seed", "rng_step"):  # uint32 counters carried as int32 bits
            sampling[name] = jax.lax.bitcast_convert_type(b[name], jnp.uint32)
        input_ids, k = b["input_ids"], layout.num_spec_tokens
        if k:
            draft_kv_caches, drafts, draft_probs = propose_drafts(
                self.draft.forward(draft_params), draft_kv_caches, b, sampling, self.draft.rope,
                layout=layout)
            input_ids = input_ids.at[b["draft_token_index"].reshape(-1)].set(
                drafts.reshape(-1), mode="drop")  # draft slots get their drafts
        meta = AttentionMetadata(b["positions"], b["slot_mapping"], b["query_start_loc"],
                                 b["kv_lens"], b["block_tables"], *self.target.rope,
                                 decode=layout.decode)
        indices = b["logits_indices"]  # [L, K+1]
        rows = indices.reshape(-1)
        if layout.num_prompt_logprobs:  # the prompt positions scored, after the sampled rows
            rows = jnp.concatenate([rows, b["prompt_logprobs_indices"]])
        logits, kv_caches = self.target.forward(params)(input_ids, kv_caches, meta, rows)
        prompt = ()
        if layout.num_prompt_logprobs:
            logits, prompt_logits = logits[: indices.size], logits[indices.size :]
            prompt = score_prompt_tokens(prompt_logits, b["prompt_logprobs_token_ids"])
        flags = dict(all_greedy=layout.all_greedy, use_filters=layout.use_filters)
        if not k:
            out = sample(logits, sampling, num_top_logprobs=layout.num_top_logprobs, **flags)
            out = tuple(None if x is None else x[:, None] for x in out)  # [L, 1, ...]
            return kv_caches, draft_kv_caches, StepOutput(*out, *prompt)
        logits = logits.reshape(*indices.shape, -1)  # [L, K+1, V]
        seqs = b["sample_seq"]  # [L]: the sequence whose drafts row l verifies
        tokens, _ = rejection_sample(
            logits, drafts[seqs], None if draft_probs is None else draft_probs[seqs],
            b["num_draft_tokens"], sampling, **flags)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        return kv_caches, draft_kv_caches, StepOutput(tokens, *gather_logprobs(
            logprobs, tokens, layout.num_top_logprobs), *prompt)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(caches: tuple[list[KVCache], ...], copies: jax.Array) -> tuple:
    """Copy-on-write: block copies[:, 1] becomes a copy of block copies[:, 0] in every layer of
    every model (target and draft); a dst past the pool is padding, dropped."""
    src, dst = copies[:, 0], copies[:, 1]
    return tuple([(k.at[dst].set(k[src], mode="drop"), v.at[dst].set(v[src], mode="drop"))
                  for k, v in model_caches] for model_caches in caches)
