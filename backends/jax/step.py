"""The JAX step body: the whole step on the device, traced by the runner's jit once per
(layout, variant) and compiled ahead of time (runner.py).

Drafts first when the step speculates (spec_step.py: the draft's catch-up and its k - 1
autoregressive steps; drafts the host proposed arrive in the draft slots instead), then the
target's forward over the flattened batch, sampling or the rejection sampler, and each row's
first token kept on the device for the next step's inputs (async scheduling). On an accelerator
a decode-shaped step runs one of two branch-free variants (PLAIN, FULL): no conditional or loop
is left for XLA to run as a host round trip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.jax.model import KVCache
from pagedjax.backends.jax.params import DeviceModel
from pagedjax.backends.jax.rejection_sampler import rejection_sample
from pagedjax.backends.jax.sampler import gather_logprobs, sample, score_prompt_tokens
from pagedjax.backends.jax.spec_step import (
    carry,
    catch_up_metadata,
    propose_drafts,
    shift_ahead,
)
from pagedjax.core.batch import SAMPLING_FIELDS, StepFlag, StepOutput, unpack
from pagedjax.core.step_shapes import BatchLayout
from pagedjax.sampling_params import MAX_LOGPROBS

# The variant of a decode step whose rows use no optional sampling feature (greedy, no logprobs,
# logit entries or bitmask: StepFlags() all off), compiled with the flags known, so without a
# conditional: on a GPU XLA ran some of the step's `lax.cond`s as a copy of the predicate to the
# host and a wait, so the 1B batch-1 step could not run ahead of the host (H100: its executable
# took 3.3 ms back to back and 3.3 ms waited for, against 1.7 ms of kernels). torch's "plain"
# CUDA graph is the same idea.
PLAIN = "plain"
# The variant of every other decode-shaped step (decode or speculative) on an accelerator: every
# sampling feature traced in and run over masks (logit entries, bitmask, filters, sampling,
# logprobs: a no-op for the rows that ask nothing), and the draft loop unrolled, so that no
# conditional or loop is left (torch's "full" graph).
FULL = "full"


def decode_shaped(layout: BatchLayout) -> bool:
    """A decode step, or a speculative one: every row at its last tokens (K + 1 at most)."""
    return layout.decode or layout.num_spec_tokens > 0


@dataclasses.dataclass(eq=False)  # compared and hashed by identity (jit keys on it)
class StepBody:
    """A runner's step function: its models, and where the next step's inputs live."""

    __name__ = "step"  # jit's name for it: XLA's module is "jit_step" (dumps, profiles)
    target: DeviceModel
    draft: DeviceModel | None
    max_num_seqs: int  # R: the rows of last_tokens
    inputs_sharding: Sharding | None  # under tensor parallelism: the host inputs' (replicated)
    block_size: int = 16  # the KV cache's (a speculative step launched ahead finds its slots)

    def __call__(self, params: dict, draft_params: dict | None, kv_caches: list[KVCache],
                 draft_kv_caches: list[KVCache], ints: jax.Array, floats: jax.Array,
                 entry_ints: jax.Array, entry_bias: jax.Array, token_bitmask: jax.Array,
                 last_tokens: jax.Array, out_buffers: StepOutput | None, *,
                 layout: BatchLayout, variant: str | None = None) -> tuple:
        """The whole step on the device → (caches, draft caches, what the next step reads of
        its tokens [3, R] (spec_step.carry), StepOutput with tokens and logprobs [L, K+1] and,
        computed where the step's flags ask, top logprobs and prompt logprobs). variant PLAIN:
        every flag off, FULL: every flag on, known here: no branches. last_tokens [3, R]: the
        last step's carry, whose last tokens are the inputs of the rows whose input_rows say so
        (async scheduling; a speculative step launched ahead also moves by the drafts it
        accepted: spec_step.shift_ahead); donated, and the first output of its shape, so that
        jax gives its buffer to the carry out. out_buffers: the StepOutput's own buffers
        (donated), written in place."""
        b = unpack(layout, ints, floats)
        if layout.draft and layout.num_spec_tokens:
            b = shift_ahead(b, last_tokens, layout=layout, block_size=self.block_size)
        rows = b["input_rows"]  # [T]: 1 + a row of last_tokens, or 0
        b["input_ids"] = jnp.where(rows > 0, last_tokens[0][jnp.maximum(rows - 1, 0)],
                                   b["input_ids"])
        flags = b["step_flags"] != 0  # [len(StepFlag)] bool
        if variant is not None:
            flags = np.full(len(StepFlag), variant == FULL)
        sampling = {name: b[name] for name in SAMPLING_FIELDS}
        for name in ("rng_seed", "rng_step"):  # uint32 counters carried as int32 bits
            sampling[name] = jax.lax.bitcast_convert_type(b[name], jnp.uint32)
        sampling["entries"] = (entry_ints, entry_bias)
        sampling["token_bitmask"] = token_bitmask  # [S, W]
        input_ids, k = b["input_ids"], layout.num_spec_tokens
        if k and not layout.draft:  # the host's drafts (n-gram), already in their slots
            drafts = input_ids[jnp.minimum(b["draft_token_index"], layout.num_tokens - 1)]
        elif k:
            draft_kv_caches, drafts = propose_drafts(
                self.draft.forward(draft_params), draft_kv_caches, b, self.draft.rope,
                layout=layout, unroll=variant is not None)
            input_ids = input_ids.at[b["draft_token_index"].reshape(-1)].set(
                drafts.reshape(-1), mode="drop")  # draft slots get their drafts
        elif layout.draft:  # a mixed step: the draft only catches up (its KV, no logits)
            _, draft_kv_caches = self.draft.hidden(draft_params)(
                b["draft_input_ids"], draft_kv_caches, catch_up_metadata(b, self.draft.rope))
        meta = AttentionMetadata(b["positions"], b["slot_mapping"], b["query_start_loc"],
                                 b["kv_lens"], b["block_tables"], *self.target.rope,
                                 decode=layout.decode)
        hidden, kv_caches = self.target.hidden(params)(input_ids, kv_caches, meta)  # [T, H]
        indices = b["logits_indices"]  # [L, K+1]
        if k and not layout.draft:  # host drafts: every real token row is a logits row
            logits = verifying_logits(self.target.logits(params), hidden, indices,
                                      b["query_start_loc"][-1])
        else:
            num_samples = indices.shape[0] - b["num_padding_samples"][0]
            logits = self.target.logits(params)(hidden[indices.reshape(-1)],
                                                num_samples * indices.shape[1])
        # Only a mixed step scores prompt tokens: in a decode-shaped one every sequence is
        # past its prompt, or at its single token (which scores nothing).
        prompt = no_prompt_logprobs(hidden)
        if not (layout.decode or k):
            prompt = jax.lax.cond(
                flags[StepFlag.PROMPT_LOGPROBS], lambda h: score_prompt_tokens(
                    self.target.logits(params)(h[b["prompt_logprobs_indices"]]),
                    b["prompt_logprobs_token_ids"]), no_prompt_logprobs, hidden)
        if not k:
            out = sample(logits, sampling, flags)
            out = StepOutput(*(x[:, None] for x in out), *prompt)  # [L, 1, ...]
            return (kv_caches, draft_kv_caches, self.carry(out.tokens, b),
                    written(out, out_buffers))
        logits = logits.reshape(*indices.shape, -1)  # [L, K+1, V]
        seqs = b["sample_seq"]  # [L]: the sequence whose drafts row l verifies
        tokens, _ = rejection_sample(logits, drafts[seqs], None, b["num_draft_tokens"],
                                     sampling, flags)
        lse = jax.nn.logsumexp(logits, axis=-1)  # [L, K+1]
        out = StepOutput(tokens, *gather_logprobs(logits, lse, tokens, flags[StepFlag.LOGPROBS]),
                         *prompt)
        return kv_caches, draft_kv_caches, self.carry(tokens, b), written(out, out_buffers)

    def carry(self, tokens: jax.Array, b: dict[str, jax.Array]) -> jax.Array:
        """[L, K+1] → what the next step reads of them [3, R] (spec_step.carry)."""
        verified = b.get("num_draft_tokens")  # [L]; none in a step without drafts
        if verified is None:
            verified = jnp.zeros(tokens.shape[0], jnp.int32)
        out = carry(tokens, verified, self.max_num_seqs)
        if self.inputs_sharding is not None:  # where the next step expects its host inputs
            out = jax.lax.with_sharding_constraint(out, self.inputs_sharding)
        return out


def written(out: StepOutput, buffers: StepOutput | None) -> StepOutput:
    """out's fields written into the step's own buffers (donated: XLA writes them in place), or
    out where it has none."""
    if buffers is None:
        return out
    return StepOutput(*(jax.lax.dynamic_update_slice(b, x.astype(b.dtype), (0,) * x.ndim)
                        for x, b in zip(out, buffers)))


def verifying_logits(logits_fn, hidden: jax.Array, indices: jax.Array,
                     num_tokens: jax.Array) -> jax.Array:
    """[L * (K+1), V] logits of a step verifying the host's drafts, from hidden [T, H].
    There every real token row is a logits row (a sequence's last token, then its drafts), so
    the head runs on the first num_tokens rows in place (the packed CPU head skips the rest),
    not on L * (K+1) gathered ones: a sequence that proposed d < K drafts adds d + 1 rows, not
    K + 1 (n-gram at batch 16 where a quarter of the sequences match: 32 rows, not 80). Its
    positions past d read its last draft's row, as the rejection sampler expects of them."""
    return logits_fn(hidden, num_tokens)[indices.reshape(-1)]


def no_prompt_logprobs(hidden: jax.Array) -> tuple[jax.Array, ...]:
    """score_prompt_tokens' four outputs for T rows, as zeros (a step scoring no prompt)."""
    t = hidden.shape[0]
    return (jnp.zeros(t, jnp.float32), jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.float32), jnp.zeros(t, jnp.int32))


def copy_blocks(caches: tuple[list[KVCache], ...], copies: jax.Array) -> tuple:
    """Copy-on-write: block copies[:, 1] becomes a copy of block copies[:, 0] in every layer of
    every model (target and draft); a dst past the pool is padding, dropped."""
    src, dst = copies[:, 0], copies[:, 1]
    return tuple([(k.at[dst].set(k[src], mode="drop"), v.at[dst].set(v[src], mode="drop"))
                  for k, v in model_caches] for model_caches in caches)
