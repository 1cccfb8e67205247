"""A runner that computes no model: each logits row gets a token fixed by its position.

It measures the engine's host work alone (benchmarks/host_overhead.py) and drives the engine
end to end in tests in milliseconds. Its steps take no device time, so what a step costs with
it is what the engine's Python costs: schedule, prepare, launch, update and outputs. It honours
what the engine reads back: a grammar's token bitmask (the first allowed token from the fixed
one on), drafts (verified as a model would: a draft is kept while it is the fixed token at its
position; the draft model's, which this runner does not propose, never are), top logprobs (the
fixed token, then the next ids, at -rank) and prompt logprobs (zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import ModelInput, ModelOutput, StepOutput
from pagedjax.core.step_shapes import BatchLayout, StepShapes
from pagedjax.sampling_params import MAX_LOGPROBS


def fixed_tokens(positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token each row samples after a context of `positions` + 1 tokens: a fixed,
    position-dependent id in [1, vocab_size) (never a function of the inputs)."""
    return (1 + (positions.astype(np.int64) * 7919) % (vocab_size - 1)).astype(np.int32)


class FixedTokenRunner:
    """ModelRunner with no model (see the module docstring)."""

    async_launch = False
    async_scheduling = True  # it reads input_rows (the token never depends on them)
    async_speculation = False  # speculative steps wait for the last one's tokens
    idle_cores_between_steps = True
    num_compiles = 0
    num_cache_hits = 0

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 draft_model_config: ModelConfig | None, shapes: StepShapes) -> None:
        del draft_model_config
        self.vocab_size = model_config.vocab_size
        self.num_kv_blocks = (config.num_gpu_blocks_override
                              or config.max_num_seqs * config.max_blocks_per_seq)
        self.shapes = shapes
        self.num_steps = 0

    @staticmethod
    def default_dtype(model_config: ModelConfig) -> str:
        del model_config
        return "float32"

    @staticmethod
    def min_decode_rows() -> int:
        return 1

    def cache_key(self) -> str:
        return f"fixed-tokens {self.vocab_size} {self.num_kv_blocks}"

    def compile_plan(self, layouts: list[BatchLayout]) -> list[Hashable]:
        del layouts
        return []

    def compile(self, layouts: list[BatchLayout], on_compiled: Callable[[], None]) -> None:
        del layouts, on_compiled

    def execute_async(self, model_input: ModelInput) -> Callable[[], ModelOutput]:
        """Nothing runs until the output is asked for: the launch costs the host nothing, as
        a device's asynchronous launch would not."""
        return lambda: self.execute(model_input)

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.num_steps += 1
        f = model_input.fields()
        num_rows, k = model_input.num_logits, model_input.layout.num_spec_tokens
        last = f["logits_indices"][:num_rows, 0]  # [L] token row each logits row samples at
        tokens = np.full((num_rows, k + 1), -1, np.int32)
        tokens[:, 0] = fixed_tokens(f["positions"][last], self.vocab_size)
        if model_input.token_bitmask is not None:
            tokens[:, 0] = self._allowed(tokens[:, 0], model_input.token_bitmask[:num_rows])
        elif k:
            tokens = self._verify(f, num_rows, k)
        zeros = np.zeros((num_rows, k + 1), np.float32)
        top = model_input.flags.logprobs
        n = model_input.num_prompt_logprobs
        ranks = np.arange(MAX_LOGPROBS, dtype=np.int32)
        out = StepOutput(
            tokens, zeros,
            ((tokens[:, :, None] + ranks) % self.vocab_size).astype(np.int32) if top else None,
            np.broadcast_to(-ranks.astype(np.float32), (num_rows, k + 1, MAX_LOGPROBS))
            if top else None,
            np.ones((num_rows, k + 1), np.int32) if top else None,
            *((np.zeros(n, np.float32), np.zeros((n, MAX_LOGPROBS), np.int32),
               np.zeros((n, MAX_LOGPROBS), np.float32), np.ones(n, np.int32))
              if model_input.flags.prompt_logprobs else ()))
        return ModelOutput.from_step(model_input, out)

    def _verify(self, f: dict[str, np.ndarray], num_rows: int, k: int) -> np.ndarray:
        """[L, K+1]: each row's drafts kept while each is the fixed token of the position
        before its slot, then the fixed token after the last one kept."""
        rows = f["logits_indices"][:num_rows]  # [L, K+1]: the last real token, then drafts
        want = fixed_tokens(f["positions"][rows], self.vocab_size)  # [L, K+1]
        seqs = f["sample_seq"][:num_rows]
        index = np.minimum(f["draft_token_index"][seqs], len(f["input_ids"]) - 1)  # [L, K]
        drafts = f["input_ids"][index]
        valid = np.arange(k)[None, :] < f["num_draft_tokens"][:num_rows, None]
        kept = np.cumprod((drafts == want[:, :k]) & valid, axis=1).sum(axis=1)  # [L]
        return np.where(np.arange(k + 1)[None, :] <= kept[:, None], want, -1).astype(np.int32)

    def _allowed(self, tokens: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
        """Each row's first token allowed by its bitmask [L, W], from its fixed token on."""
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, : self.vocab_size].astype(bool)  # [L, V]
        order = (np.arange(self.vocab_size)[None, :] - tokens[:, None]) % self.vocab_size
        return np.where(allowed, order, self.vocab_size).argmin(axis=1).astype(np.int32)

    def shutdown(self) -> None:
        pass
