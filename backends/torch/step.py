"""The torch step body: the whole step on the device, run eagerly or captured into a CUDA graph
per (layout, variant) by the runner (runner.py, cuda_graphs.py).

Drafts first when the step speculates (spec_step.py: the draft's catch-up and its k - 1
autoregressive steps; drafts the host proposed arrive in the draft slots instead), then the
target's forward over the flattened batch, sampling or the rejection sampler, and each row's
first token kept on the device for the next step's inputs (async scheduling), with no host
synchronisation until the sampled tokens come back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.torch.params import DeviceModel
from pagedjax.backends.torch.rejection_sampler import rejection_sample
from pagedjax.backends.torch.sampler import (
    gather_logprobs,
    logits_stats,
    sample,
    score_prompt_tokens,
)
from pagedjax.backends.torch.spec_step import keep_carry, propose_drafts, shift_ahead
from pagedjax.core.batch import SAMPLING_FIELDS, StepFlags, StepOutput, unpack
from pagedjax.core.step_shapes import BatchLayout
from pagedjax.sampling_params import MAX_LOGPROBS

# what StepBody.greedy_decode_step reads of a step's fields
GREEDY_DECODE_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables",
                        "logits_indices")


@dataclass(eq=False)
class StepBody:
    """A runner's step function: its models (target, then the draft) and the device buffer of
    the last step's first tokens."""

    models: list[DeviceModel]
    # [3, max_num_seqs] int32 (spec_step.keep_carry): one buffer, so graphs capture it
    last_tokens: torch.Tensor
    async_launch: bool  # steps may be launched before the last one's tokens reach the host
    block_size: int = 16  # the KV cache's (a speculative step launched ahead finds its slots)

    def __call__(self, ints: torch.Tensor, floats: torch.Tensor,
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
        if (layout.decode and not layout.draft and flags == StepFlags()
                and not self.async_launch):  # every row greedy, and nothing else asked
            out = self.greedy_decode_step(unpack(layout, ints, floats, GREEDY_DECODE_FIELDS),
                                          num_tokens, num_samples)
            if out is not None:
                return out
        b = unpack(layout, ints, floats)
        k = layout.num_spec_tokens
        if self.async_launch and layout.draft and k:  # launched ahead: moved by what the
            b = shift_ahead(b, self.last_tokens, layout=layout,  # last step accepted
                            block_size=self.block_size)
        sampling = {name: b[name] for name in SAMPLING_FIELDS}
        for name in ("rng_seed", "rng_step"):  # uint32 counters, emulated in int64
            sampling[name] = b[name].to(torch.int64) & 0xFFFFFFFF
        if entries is not None:
            sampling["entries"] = entries
        if token_bitmask is not None:
            sampling["token_bitmask"] = token_bitmask  # [S, W]
        target = self.models[0]
        input_ids = b["input_ids"]
        if self.async_launch:  # only then may a step be scheduled before the last one's tokens
            rows = b["input_rows"]  # [T]: 1 + a row of last_tokens, or 0 (input_ids)
            input_ids = torch.where(
                rows > 0, self.last_tokens[0][(rows - 1).clamp(min=0).long()], input_ids)
        if layout.draft:
            draft = self.models[1]
            drafts = propose_drafts(draft.forward, draft.kv_caches, b, draft.rope,
                                    layout=layout, max_query_len=max_draft_query_len,
                                    num_tokens=num_draft_tokens,
                                    greedy_decode=draft.greedy_decode)
        if k:  # index T (no draft) lands in a discarded extra row
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1)])
            if layout.draft:  # draft slots get the draft model's drafts
                input_ids[b["draft_token_index"].reshape(-1).long()] = drafts.reshape(-1)
            else:  # the host's drafts (n-gram), already in their slots
                drafts = input_ids[b["draft_token_index"].long()]  # [S, K]
        input_ids = input_ids[:num_tokens]
        meta = AttentionMetadata(b["positions"][:num_tokens], b["slot_mapping"][:num_tokens],
                                 b["query_start_loc"], b["kv_lens"], b["block_tables"],
                                 *target.rope, max_query_len=max_query_len)
        indices = b["logits_indices"]  # [L, K+1]
        prompt = ()
        if k and not layout.draft:  # host drafts: every real token row is a logits row, so
            # the head runs on those (a sequence that proposed d < K drafts adds d + 1 rows,
            # not K + 1); its positions past d read its last draft's row (jax's
            # verifying_logits)
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)
            logits = target.forward(input_ids, target.kv_caches, meta, rows)
            logits = logits.index_select(0, indices.reshape(-1).long())
        else:
            rows = indices[: indices.shape[0] if num_samples is None else num_samples]
            rows = rows.reshape(-1)
            num_rows = rows.numel()
            if flags.prompt_logprobs:  # the prompt positions scored, after the sampled rows
                rows = torch.cat([rows, b["prompt_logprobs_indices"]])
            logits = target.forward(input_ids, target.kv_caches, meta, rows)
            if flags.prompt_logprobs:
                logits, prompt_logits = logits[:num_rows], logits[num_rows:]
                prompt = score_prompt_tokens(prompt_logits, b["prompt_logprobs_token_ids"])
            if num_rows < indices.numel():  # the padding rows: zeros
                logits = torch.nn.functional.pad(logits, (0, 0, 0, indices.numel() - num_rows))
        if not k:
            out = sample(logits, sampling, flags)
            self.keep_carry(out[0][:, None], None)
            return StepOutput(*(None if x is None else x[:, None] for x in out), *prompt)
        raw_argmax, lse = (x.view(indices.shape) for x in logits_stats(logits))  # [L, K+1]
        logits = logits.view(*indices.shape, -1)  # [L, K+1, V]
        seqs = b["sample_seq"].long()  # [L]: the sequence whose drafts row l verifies
        tokens, _ = rejection_sample(logits, drafts[seqs], None, b["num_draft_tokens"],
                                     sampling, all_greedy=not flags.sampled,
                                     use_filters=flags.filters, raw_argmax=raw_argmax)
        self.keep_carry(tokens, b["num_draft_tokens"])
        return StepOutput(tokens, *gather_logprobs(
            logits, lse, tokens, MAX_LOGPROBS if flags.logprobs else 0), *prompt)

    def greedy_decode_step(self, b: dict[str, torch.Tensor], num_tokens: int,
                           num_samples: int | None) -> StepOutput | None:
        """A decode step whose rows take the argmax and ask for nothing else, as one C++ op
        where the target has it (DeviceModel.greedy_decode: the forward, logits_stats and the
        tokens' logprobs, the same bits as the general path below, without its ~25 small ops
        around the forward); None where it has not. b: the step's fields; the first num_tokens
        tokens (one a sequence) are real, and the first num_samples logits rows (None: all)."""
        positions = b["positions"][None, :num_tokens]  # [1, T]: token t is sequence t's
        decoded = self.models[0].greedy_decode(
            b["input_ids"][:num_tokens], positions, b["slot_mapping"][None, :num_tokens],
            b["block_tables"][:num_tokens])
        if decoded is None:
            return None
        indices = b["logits_indices"][:, 0]  # [L]: the token each row samples
        rows = indices[: indices.shape[0] if num_samples is None else num_samples].long()
        return StepOutput(*(x[0, rows][:, None] for x in decoded))  # [L, 1] each

    def keep_carry(self, tokens: torch.Tensor, num_draft_tokens: torch.Tensor | None) -> None:
        """[L, K+1] → what the next step reads of them into last_tokens (spec_step.keep_carry;
        read on the device when it is launched before these reach the host: a CPU never is)."""
        if self.async_launch:
            keep_carry(self.last_tokens, tokens, num_draft_tokens)


def copy_blocks(models: list[DeviceModel], copies: torch.Tensor) -> None:
    """Copy-on-write: block copies[:, 1] becomes a copy of block copies[:, 0] in every layer
    of every model (target and draft)."""
    src, dst = copies[:, 0].long(), copies[:, 1].long()  # [C] each
    for model in models:  # the gather copies first, as the JAX .at[].set
        pool = model.kv_pool  # as bytes where fp8: torch has no index_copy_ of float8 on CPU
        pool = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
        pool.index_copy_(2, dst, pool.index_select(2, src))

