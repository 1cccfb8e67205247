"""JAX model runner: owns the params and KV caches, runs one jitted step per batch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.backends.jax.attention import resolve_attention
from pagedjax.backends.jax.model import AttentionMetadata, KVCache, LlamaForCausalLM
from pagedjax.backends.jax.params import load_params
from pagedjax.backends.jax.rejection_sampler import rejection_sample, sampling_probs
from pagedjax.backends.jax.sampler import gather_logprobs, sample
from pagedjax.backends.rope import rope_cos_sin
from pagedjax.batch import ModelInput, ModelOutput
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.kv_cache import num_kv_blocks_for_budget, warm_up_input

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "rng_seed", "rng_step",
                    "banned_rows", "banned_token_ids")


class JaxModelRunner:
    """Executes ModelInputs; returns sampled token ids and logprobs (nothing else leaves)."""

    def __init__(self, model_dir: str, model_config: ModelConfig, config: EngineConfig,
                 *, extra_bytes_per_block: int = 0) -> None:
        self.model_config = model_config
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        attention_fn, write_kv_fn, self.attention_impl = resolve_attention(config.attention_impl)
        self.model = LlamaForCausalLM(model_config, self.dtype, attention_fn, write_kv_fn)
        self.params, self.params_source = load_params(model_dir, model_config, self.dtype)
        cos, sin = rope_cos_sin(model_config, config.max_model_len)
        self.rope = (jnp.asarray(cos), jnp.asarray(sin))
        self.num_compiles = 0  # traces of the step function: must stay bounded
        self._step = jax.jit(self._step_fn, donate_argnums=(1,),
                             static_argnames=("num_top_logprobs", "all_greedy", "use_filters",
                                              "return_probs"))
        self.kv_caches: list[KVCache] = []
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_memory(extra_bytes_per_block)
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)

    def _allocate_kv_caches(self, num_blocks: int) -> list[KVCache]:
        cfg = self.model_config
        shape = (num_blocks, cfg.num_kv_heads, self.config.block_size, cfg.head_dim)
        return [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                for _ in range(cfg.num_layers)]

    def _blocks_from_memory(self, extra_bytes_per_block: int) -> int:
        """On an accelerator: what memory_utilization leaves after the weights and the peak of
        the heaviest step (run once on throwaway caches). UNVERIFIED on a GPU."""
        device = jax.devices()[0]
        stats = None
        if device.platform != "cpu":
            model_input = warm_up_input(self.config)
            self.kv_caches = self._allocate_kv_caches(int(model_input.block_tables.max()) + 1)
            self.execute(model_input)
            self.kv_caches = []
            memory = device.memory_stats()
            stats = {"bytes_limit": memory["bytes_limit"],
                     "bytes_in_use": memory.get("peak_bytes_in_use", memory["bytes_in_use"])}
        return num_kv_blocks_for_budget(self.model_config, self.config, stats,
                                        extra_bytes_per_block=extra_bytes_per_block)

    def _step_fn(self, params, kv_caches, batch, sampling, spec, *, num_top_logprobs: int,
                 all_greedy: bool, use_filters: bool, return_probs: bool):
        self.num_compiles += 1  # runs only while tracing
        meta = AttentionMetadata(batch["positions"], batch["slot_mapping"],
                                 batch["query_start_loc"], batch["kv_lens"],
                                 batch["block_tables"], *self.rope)
        indices = batch["logits_indices"]  # [L] or [L, K+1]
        logits, kv_caches = self.model.apply(params, batch["input_ids"], kv_caches, meta,
                                             indices.reshape(-1))
        flags = dict(all_greedy=all_greedy, use_filters=use_filters)
        if spec is None:
            out = sample(logits, sampling, num_top_logprobs=num_top_logprobs, **flags)
            probs = sampling_probs(logits, sampling, **flags) if return_probs else None
            return kv_caches, (*out, probs)
        logits = logits.reshape(*indices.shape, -1)  # [L, K+1, V]
        tokens, _ = rejection_sample(logits, spec["draft_token_ids"], spec["draft_probs"],
                                     spec["num_draft_tokens"], sampling, **flags)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        return kv_caches, (tokens, *gather_logprobs(logprobs, tokens, num_top_logprobs), None)

    def execute(self, model_input: ModelInput, draft_probs: list | None = None) -> ModelOutput:
        """Run one batch. With model_input.spec, verify its drafts against draft_probs (the
        draft runner's per-pass q, still on the device)."""
        if len(model_input.block_copies):
            self.kv_caches = _copy_blocks(self.kv_caches, jnp.asarray(model_input.block_copies))
        batch = {k: jnp.asarray(getattr(model_input, k)) for k in (
            "input_ids", "positions", "slot_mapping", "query_start_loc", "kv_lens",
            "block_tables", "logits_indices")}
        meta = model_input.sampling
        sampling = {k: jnp.asarray(getattr(meta, k)) for k in _SAMPLING_FIELDS}
        spec = None if model_input.spec is None else self._spec_inputs(model_input, draft_probs)
        self.kv_caches, out = self._step(
            self.params, self.kv_caches, batch, sampling, spec,
            num_top_logprobs=meta.num_top_logprobs, all_greedy=meta.all_greedy,
            use_filters=meta.use_filters, return_probs=meta.return_probs)
        *host, probs = out
        tokens, logprobs, top_ids, top_lps = jax.device_get(tuple(host))
        n = model_input.num_logits
        return ModelOutput(
            sampled_token_ids=np.asarray(tokens[:n]),
            sampled_logprobs=np.asarray(logprobs[:n]),
            top_logprob_ids=None if top_ids is None else np.asarray(top_ids[:n]),
            top_logprobs=None if top_lps is None else np.asarray(top_lps[:n]),
            probs=probs,
        )

    def _spec_inputs(self, model_input: ModelInput, draft_probs: list | None) -> dict:
        """Device inputs of verification; q [L, K, V] gathered from the draft's passes."""
        spec = model_input.spec
        num_rows, k = spec.draft_token_ids.shape
        vocab = self.model_config.vocab_size
        columns = [jnp.asarray(draft_probs[j])[spec.draft_rows[:, j]]
                   if draft_probs and j < len(draft_probs) and draft_probs[j] is not None
                   else jnp.zeros((num_rows, vocab), jnp.float32) for j in range(k)]
        return {"draft_token_ids": jnp.asarray(spec.draft_token_ids),
                "num_draft_tokens": jnp.asarray(spec.num_draft_tokens),
                "draft_probs": jnp.stack(columns, axis=1)}


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(kv_caches: list[KVCache], copies: jax.Array) -> list[KVCache]:
    """Copy-on-write: block copies[:, 1] becomes a copy of block copies[:, 0] in every layer."""
    src, dst = copies[:, 0], copies[:, 1]
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]
