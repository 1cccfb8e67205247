"""Torch model runner: owns the model and KV caches; one forward + on-device sampling per batch.

CPU: every batch runs eagerly on the C++ CPU ops. CUDA: decode batches replay CUDA graphs
(cuda_graphs.py), other batches run eagerly, and the KV pool is sized from the device memory left
after a warm-up forward of the largest batch. Only token ids and logprobs come back to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedjax.backends.rope import rope_cos_sin
from pagedjax.backends.torch.cuda_graphs import DecodeGraphs, HostToDevice, StaticBatch
from pagedjax.backends.torch.model import (
    AttentionFn,
    AttentionMetadata,
    KVCache,
    WriteKVFn,
    load_model,
)
from pagedjax.backends.torch.rejection_sampler import rejection_sample, sampling_probs
from pagedjax.backends.torch.sampler import gather_logprobs, sample
from pagedjax.batch import ModelInput, ModelOutput, SamplingMetadata
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.kernels_cuda import ragged_paged_attention, reference, write_kv
from pagedjax.kv_cache import num_kv_blocks_for_budget, warm_up_input

ATTENTION_IMPLS = ("auto", "reference")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BATCH_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "kv_lens",
                 "block_tables")
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "rng_seed", "rng_step",
                    "banned_rows", "banned_token_ids")


def resolve_attention(attention_impl: str) -> tuple[AttentionFn, WriteKVFn]:
    """"auto": the pagedjax custom ops (CUDA, C++ CPU); "reference": their pure-torch reference."""
    if attention_impl == "auto":
        return ragged_paged_attention, write_kv
    if attention_impl == "reference":
        return _reference_attention, reference.write_kv
    raise ValueError(f"attention_impl={attention_impl!r} is not available on the torch backend; "
                     f"use one of {ATTENTION_IMPLS}.")


def _reference_attention(*args, max_query_len: int | None = None, **kwargs) -> torch.Tensor:
    """The reference reads the metadata on the host: it needs no launch hint."""
    del max_query_len
    return reference.ragged_paged_attention(*args, **kwargs)


class TorchModelRunner:
    """Executes ModelInputs; returns sampled token ids and logprobs (nothing else leaves)."""

    def __init__(self, model_dir: str, model_config: ModelConfig, config: EngineConfig,
                 *, extra_bytes_per_block: int = 0) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _DTYPES[config.dtype]
        self.model = load_model(model_dir, model_config, self.dtype, self.device,
                                *resolve_attention(config.attention_impl))
        cos, sin = rope_cos_sin(model_config, config.max_model_len)  # [max_model_len, D] each
        self.rope = (torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device))
        self.upload = HostToDevice(self.device)
        self.decode_graphs: DecodeGraphs | None = None  # none while the pool is sized
        self.kv_caches: list[KVCache] = []
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_memory(extra_bytes_per_block)
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        if self.device.type == "cuda":
            self.decode_graphs = DecodeGraphs(self._graph_forward, config.max_blocks_per_seq,
                                              self.device)

    @property
    def num_compiles(self) -> int:
        """CUDA graphs captured, one per padded decode shape (T, S); 0 on CPU (all eager)."""
        return 0 if self.decode_graphs is None else len(self.decode_graphs.graphs)

    def _allocate_kv_caches(self, num_blocks: int) -> list[KVCache]:
        cfg = self.model_config
        shape = (num_blocks, cfg.num_kv_heads, self.config.block_size, cfg.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [(zeros(), zeros()) for _ in range(cfg.num_layers)]

    def _blocks_from_memory(self, extra_bytes_per_block: int) -> int:
        stats = self._cuda_memory_after_warm_up() if self.device.type == "cuda" else None
        return num_kv_blocks_for_budget(self.model_config, self.config, stats,
                                        extra_bytes_per_block=extra_bytes_per_block)

    def _cuda_memory_after_warm_up(self) -> dict[str, int]:
        """{"bytes_limit", "bytes_in_use"}: weights + the largest step's activation peak + what
        torch's allocator does not hold (CUDA context, other processes such as JAX).

        UNVERIFIED on a GPU. CUDA graphs captured later take their own (decode-sized) pool out
        of the 1 - memory_utilization headroom.
        """
        torch.cuda.reset_peak_memory_stats()
        self.warm_up()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside_torch = total - free - torch.cuda.memory_reserved()
        return {"bytes_limit": total,
                "bytes_in_use": torch.cuda.max_memory_allocated() + outside_torch}

    def warm_up(self) -> None:
        """Execute the heaviest step the scheduler can produce, on throwaway KV caches."""
        model_input = warm_up_input(self.config)
        kv_caches = self.kv_caches
        self.kv_caches = self._allocate_kv_caches(int(model_input.block_tables.max()) + 1)
        self.execute(model_input)
        self.kv_caches = kv_caches

    # ---- execute -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, draft_probs: list | None = None) -> ModelOutput:
        """Run one batch. With model_input.spec, verify its drafts against draft_probs (the
        draft runner's per-pass q, still on the device)."""
        if len(model_input.block_copies):
            self._copy_blocks(self.upload("block_copies", model_input.block_copies))
        indices = model_input.logits_indices  # [L] or [L, K+1]
        logits_indices = self.upload("logits_indices", indices.reshape(-1))
        if (self.decode_graphs is not None and model_input.spec is None
                and DecodeGraphs.applies(model_input)):
            logits = self.decode_graphs.run(model_input, self.upload)  # [T, V], rows = seqs
            logits = logits.index_select(0, logits_indices)  # [L, V]
        else:
            batch = {name: self.upload(name, getattr(model_input, name)) for name in _BATCH_FIELDS}
            max_query_len = int(np.diff(model_input.query_start_loc).max())
            logits = self._run_model(batch, logits_indices, max_query_len)  # [L(K+1), V]
        meta = model_input.sampling
        sampling = self._sampling_tensors(meta)
        flags = dict(all_greedy=meta.all_greedy, use_filters=meta.use_filters)
        if model_input.spec is not None:
            logits = logits.reshape(*indices.shape, -1)  # [L, K+1, V]
            tokens, _ = rejection_sample(logits, **self._spec_inputs(model_input, draft_probs),
                                         sampling=sampling, **flags)
            logprobs = torch.log_softmax(logits, dim=-1)
            out = (tokens, *gather_logprobs(logprobs, tokens, meta.num_top_logprobs))
            return self._to_host(out, model_input.num_logits)
        out = sample(logits, sampling, num_top_logprobs=meta.num_top_logprobs, **flags)
        probs = sampling_probs(logits, sampling, **flags) if meta.return_probs else None
        return self._to_host(out, model_input.num_logits, probs)

    def _spec_inputs(self, model_input: ModelInput,
                     draft_probs: list | None) -> dict[str, torch.Tensor]:
        """Verification inputs on the device; q [L, K, V] gathered from the draft's passes."""
        spec = model_input.spec
        num_rows, k = spec.draft_token_ids.shape
        rows = self.upload("draft_rows", spec.draft_rows).long()  # [L, K]
        columns = [draft_probs[j][rows[:, j]]
                   if draft_probs and j < len(draft_probs) and draft_probs[j] is not None
                   else torch.zeros(num_rows, self.model_config.vocab_size, device=self.device)
                   for j in range(k)]
        return {"draft_token_ids": self.upload("draft_token_ids", spec.draft_token_ids),
                "num_draft_tokens": self.upload("num_draft_tokens", spec.num_draft_tokens),
                "draft_probs": torch.stack(columns, dim=1)}

    def _copy_blocks(self, copies: torch.Tensor) -> None:
        """Copy-on-write: block copies[:, 1] becomes a copy of block copies[:, 0] in every layer."""
        src, dst = copies[:, 0].long(), copies[:, 1].long()  # [C] each
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]  # the gather copies first, as the JAX runner's .at[].set
            v_cache[dst] = v_cache[src]

    def _run_model(self, batch: dict[str, torch.Tensor], logits_indices: torch.Tensor,
                   max_query_len: int) -> torch.Tensor:
        """The forward on device tensors named as in ModelInput → logits [L, V] float32."""
        meta = AttentionMetadata(batch["positions"], batch["slot_mapping"],
                                 batch["query_start_loc"], batch["kv_lens"],
                                 batch["block_tables"], *self.rope, max_query_len=max_query_len)
        return self.model(batch["input_ids"], self.kv_caches, meta, logits_indices)

    def _graph_forward(self, batch: StaticBatch, rows: torch.Tensor) -> torch.Tensor:
        """What a decode CUDA graph captures: every row's logits [T, V], q_len 1."""
        return self._run_model(vars(batch), rows, max_query_len=1)

    def _sampling_tensors(self, meta: SamplingMetadata) -> dict[str, torch.Tensor]:
        arrays = {name: getattr(meta, name) for name in _SAMPLING_FIELDS}
        for name in ("rng_seed", "rng_step"):  # uint32 counters, emulated in int64 by the sampler
            arrays[name] = arrays[name].astype(np.int64)
        return {name: self.upload(name, array) for name, array in arrays.items()}

    def _to_host(self, out: tuple[torch.Tensor | None, ...], num_logits: int,
                 probs: torch.Tensor | None = None) -> ModelOutput:
        """The step's one device→host transfer (and its one synchronisation)."""
        host = [None if t is None else t[:num_logits].to("cpu", non_blocking=True) for t in out]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        tokens, logprobs, top_ids, top_lps = (None if t is None else t.numpy() for t in host)
        return ModelOutput(sampled_token_ids=tokens, sampled_logprobs=logprobs,
                           top_logprob_ids=top_ids, top_logprobs=top_lps, probs=probs)
