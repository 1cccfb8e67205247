"""Rejection sampling for speculative decoding on the torch runner.

The semantics of backends/jax/rejection_sampler.py, op for op (see its docstring for the
accepted / recovered / bonus vocabulary and the random counters), so a seeded request accepts
and samples the same tokens on either backend. No host syncs: shapes never depend on data.
"""

from __future__ import annotations

import torch

from pagedjax.backends.torch.sampler import (
    filter_logits,
    gumbel_argmax,
    process_logits,
    uniform_at,
)
from pagedjax.kernels_cuda import ops_backend

PLACEHOLDER_TOKEN_ID = -1  # pads output_token_ids after the recovered / bonus token
_MASK32 = 0xFFFFFFFF  # rng counters are uint32 values held in int64


def sampling_probs(logits: torch.Tensor, sampling: dict[str, torch.Tensor], *, all_greedy: bool,
                   use_filters: bool) -> torch.Tensor:
    """The distribution the sampler draws from (the draft returns it as q).

    logits [L, V] float32; sampling: [L] tensors (temperature, top_k, top_p, min_p).
    Returns probs [L, V] float32: one-hot(argmax) on greedy rows, softmax(filter_logits(logits / T))
    on random rows.
    """
    vocab = logits.shape[-1]
    greedy = torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), vocab).to(torch.float32)
    if all_greedy:
        return greedy
    temperature = sampling["temperature"]  # [L]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if use_filters:
        scaled = filter_logits(scaled, sampling["top_k"], sampling["top_p"], sampling["min_p"])
    return torch.where(temperature[:, None] > 0, torch.softmax(scaled, dim=-1), greedy)


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_draft_tokens: torch.Tensor,
                     sampling: dict[str, torch.Tensor], *, all_greedy: bool,
                     use_filters: bool, raw_argmax: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify each row's drafts against the target.

    target_logits    [L, K+1, V] float32: position j scores draft j; j = k is the bonus position
    draft_token_ids  [L, K] int32, valid for j < num_draft_tokens[l] (anything, e.g. -1, after)
    draft_probs      [L, K, V] float32: q_j, the draft's sampling distribution for draft j;
                     None: the drafts are the draft model's argmax (q_j one-hot at d_j)
    num_draft_tokens [L] int32 in [0, K]
    sampling         [L] tensors as in the sampler (rng_seed / rng_step int64); its logit entries
                     (banned tokens, logit_bias and penalties), if any, apply at every position
                     of their row (such rows have no drafts: the scheduler does not draft for
                     them); its token bitmask [L, W], if any, at position 0 only (structured
                     outputs: the host checks the tokens after it)
    raw_argmax       [L, K+1]: target_logits' argmax, where the caller has it (logits_stats);
                     used where the step has no logit entries or bitmask to change it
    Returns output_token_ids [L, K+1] int32 (accepted, then recovered or bonus, then -1) and
    num_accepted [L] int32.
    """
    num_drafts = draft_token_ids.shape[1]  # K
    num_rows, num_positions, vocab = target_logits.shape
    # [L * (K+1)] rows; greedy rows with no logit entries need none of the knobs
    positions = (_per_position(sampling, num_positions)
                 if not all_greedy or "entries" in sampling or "token_bitmask" in sampling
                 else {})
    if (all_greedy and not positions and raw_argmax is not None
            and raw_argmax.device.type == "cpu" and ops_backend() != "reference"):
        # the rule below as one C++ loop (the ~18 small ops here cost ~0.3 ms a step on a CPU)
        return torch.ops.pagedjax.rejection_greedy_sample(
            raw_argmax.int(), draft_token_ids.int(), num_draft_tokens.int())
    flat = target_logits.reshape(-1, vocab)
    processed = process_logits(flat, positions)[0]
    target_logits = processed.view(num_rows, num_positions, vocab)
    target_argmax = (raw_argmax.long() if raw_argmax is not None and processed is flat
                     else torch.argmax(target_logits, dim=-1))  # [L, K+1] int64
    accepted = target_argmax[:, :num_drafts] == draft_token_ids.long()  # [L, K], greedy rule
    if not all_greedy:
        target_probs = _target_probs(target_logits, positions, use_filters=use_filters)
        random_rows = (sampling["temperature"] > 0)[:, None]  # [L, 1]
        accepted = torch.where(random_rows, _accept_random(target_probs, draft_token_ids,
                                                           draft_probs, sampling), accepted)
    positions = torch.arange(num_drafts, device=target_logits.device)
    valid = positions[None, :] < num_draft_tokens[:, None]  # [L, K]
    num_accepted = torch.cumprod((accepted & valid).long(), dim=1).sum(dim=1)  # [L] int64
    next_token = torch.gather(target_argmax, 1, num_accepted[:, None])[:, 0]  # [L]
    if not all_greedy:
        sampled = _recover_or_bonus(target_probs, draft_token_ids, draft_probs, num_accepted,
                                    num_draft_tokens, sampling)
        next_token = torch.where(random_rows[:, 0], sampled, next_token)
    return _assemble(draft_token_ids, next_token, num_accepted), num_accepted.to(torch.int32)


def _per_position(sampling: dict[str, torch.Tensor], num_positions: int
                  ) -> dict[str, torch.Tensor]:
    """The sampling inputs of rows [L] for rows [L * (K+1)], position j of row l being row
    l * (K+1) + j: per-row knobs repeated, each logit entry once per position, the token
    bitmask at position 0 (every token allowed after it)."""
    out = {name: x.repeat_interleave(num_positions) for name, x in sampling.items()
           if name not in ("entries", "rng_seed", "rng_step", "token_bitmask")}
    if "token_bitmask" in sampling:
        bitmask = sampling["token_bitmask"]  # [L, W]
        out["token_bitmask"] = torch.full((bitmask.shape[0], num_positions, bitmask.shape[1]),
                                          -1, dtype=bitmask.dtype, device=bitmask.device)
        out["token_bitmask"][:, 0] = bitmask
        out["token_bitmask"] = out["token_bitmask"].reshape(-1, bitmask.shape[1])
    if "entries" in sampling:
        ints, bias = sampling["entries"]  # [4, E], [E]
        rows = ints[0][:, None] * num_positions + torch.arange(num_positions, dtype=ints.dtype,
                                                               device=ints.device)
        rows = torch.where(ints[0][:, None] >= 0, rows, -1).reshape(1, -1)  # [1, E * (K+1)]
        out["entries"] = (torch.cat([rows, ints[1:].repeat_interleave(num_positions, dim=1)]),
                          bias.repeat_interleave(num_positions))
    return out


def _target_probs(target_logits: torch.Tensor, positions: dict[str, torch.Tensor], *,
                  use_filters: bool) -> torch.Tensor:
    """p_j for every position: target_logits [L, K+1, V] → [L, K+1, V], as the sampler sees it.
    positions: the knobs per position (_per_position)."""
    num_rows, num_positions, vocab = target_logits.shape
    probs = sampling_probs(target_logits.reshape(-1, vocab), positions, all_greedy=False,
                           use_filters=use_filters)
    return probs.reshape(num_rows, num_positions, vocab)


def _accept_random(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                   draft_probs: torch.Tensor | None,
                   sampling: dict[str, torch.Tensor]) -> torch.Tensor:
    """u_j * q_j(d_j) < p_j(d_j) → [L, K] bool (safe for q = 0); u_j = column V at step + j.

    target_probs [L, K+1, V]; draft_token_ids [L, K]; draft_probs [L, K, V] or None (one-hot).
    """
    num_rows, num_drafts = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    positions = torch.arange(num_drafts, device=target_probs.device)
    steps = (sampling["rng_step"].long()[:, None] + positions) & _MASK32  # [L, K]
    seeds = sampling["rng_seed"].long()[:, None].expand(steps.shape)
    column = torch.full((1,), vocab, dtype=torch.int64, device=steps.device)
    u = uniform_at(seeds.reshape(-1), steps.reshape(-1), column)[:, 0]  # [L * K]
    index = draft_token_ids.long().clamp(0, vocab - 1)[..., None]  # padding drafts gather safely
    p = torch.gather(target_probs[:, :num_drafts], 2, index)[..., 0]  # [L, K]
    q = 1.0 if draft_probs is None else torch.gather(draft_probs, 2, index)[..., 0]  # [L, K]
    return u.reshape(num_rows, num_drafts) * q < p


def _recover_or_bonus(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                      draft_probs: torch.Tensor | None, num_accepted: torch.Tensor,
                      num_draft_tokens: torch.Tensor,
                      sampling: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token after the accepted drafts, at position n = num_accepted → [L] int64.

    Recovered ~ max(p_n - q_n, 0) after a rejection (p_n if that is all zero); bonus ~ p_n
    (q_n taken as 0). target_probs [L, K+1, V]; draft_token_ids [L, K]; draft_probs
    [L, K, V] or None (one-hot at the drafts); the rest [L].
    """
    num_drafts, vocab = draft_token_ids.shape[1], target_probs.shape[-1]
    gather_index = num_accepted[:, None, None].expand(-1, 1, vocab)  # [L, 1, V]
    p = torch.gather(target_probs, 1, gather_index)[:, 0]  # [L, V]
    q = torch.zeros_like(p)
    if num_drafts > 0:
        position = num_accepted.clamp(max=num_drafts - 1)[:, None]  # [L, 1]
        rejected = (num_accepted < num_draft_tokens)[:, None]  # [L, 1]
        if draft_probs is None:
            draft = torch.gather(draft_token_ids.long(), 1, position)[:, 0]
            q_n = torch.nn.functional.one_hot(draft, vocab).to(p.dtype)
        else:
            q_n = torch.gather(draft_probs, 1, position[:, :, None].expand(-1, 1, vocab))[:, 0]
        q = torch.where(rejected, q_n, q)
    residual = torch.clamp(p - q, min=0.0)  # [L, V]
    residual = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p)
    step = (sampling["rng_step"].long() + num_accepted) & _MASK32
    return gumbel_argmax(torch.log(residual), sampling["rng_seed"].long(), step).long()


def _assemble(draft_token_ids: torch.Tensor, next_token: torch.Tensor,
              num_accepted: torch.Tensor) -> torch.Tensor:
    """[L, K] drafts, [L] next token, [L] counts → [L, K+1]: accepted, next token, then -1."""
    num_rows, num_drafts = draft_token_ids.shape
    position = torch.arange(num_drafts + 1, device=draft_token_ids.device)[None, :]  # [1, K+1]
    drafts = torch.nn.functional.pad(draft_token_ids.long(), (0, 1), value=PLACEHOLDER_TOKEN_ID)
    n = num_accepted[:, None]
    tail = torch.where(position == n, next_token[:, None], PLACEHOLDER_TOKEN_ID)
    return torch.where(position < n, drafts, tail).to(torch.int32)
