"""On-device sampling for the torch runner: the semantics of backends/jax/sampler.py, op for op.

Order (vLLM's): raw logprobs (returned) → banned tokens (min_tokens) → logit_bias → repetition,
frequency and presence penalties → greedy rows take the argmax; random rows divide by
temperature, keep top-k, then top-p, then min-p, and take the argmax of logits + Gumbel noise
from pagedjax.random's counters (an exact categorical sample), so a seeded request samples the
same tokens on either backend.
"""

from __future__ import annotations

import torch

from pagedjax import random as prng
from pagedjax.sampling_params import MAX_LOGPROBS

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in int64 (masked after every multiply)."""
    x = x ^ (x >> 16)
    x = (x * prng.MIX_MUL_1) & _MASK32  # the low 32 bits survive an int64 wraparound
    x = x ^ (x >> 15)
    x = (x * prng.MIX_MUL_2) & _MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, step: torch.Tensor, num: int) -> torch.Tensor:
    """[L] seeds and steps (uint32 values, int64 tensors) → [L, num] float32 in (0, 1)."""
    key = _mix32(seed[:, None] ^ _mix32((step[:, None] * prng.GOLDEN) & _MASK32))
    stream = (torch.arange(num, dtype=torch.int64, device=seed.device) * prng.STREAM) & _MASK32
    bits = _mix32((key + stream[None, :]) & _MASK32)  # [L, num]
    return ((bits >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p, then min-p drop. logits [L, V]; knobs [L]."""
    vocab = logits.shape[-1]
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values  # [L, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [L]
    in_top_k = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]
    probs = torch.softmax(sorted_desc.masked_fill(~in_top_k, float("-inf")), dim=-1)
    keep = in_top_k & (torch.cumsum(probs, dim=-1) - probs < top_p[:, None])
    num_kept = keep.sum(dim=-1)  # [L] >= 1
    threshold = torch.gather(sorted_desc, 1, (num_kept - 1)[:, None])[:, 0]
    min_p_threshold = torch.where(min_p > 0, sorted_desc[:, 0] + torch.log(min_p),
                                  float("-inf"))
    threshold = torch.maximum(threshold, min_p_threshold)
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))


def _scatter(sampling: dict[str, torch.Tensor], prefix: str, num_rows: int, vocab: int,
             values: torch.Tensor | None = None) -> torch.Tensor:
    """At the (row, token) pairs sampling[prefix + "_rows"], sampling[prefix + "_token_ids"]
    [P] (row -1 pads): [L, V] bool, True there; or with values [P], their sums there.

    Padding pairs land in an extra row that is cut off (no data-dependent shapes, no host sync).
    """
    rows = sampling[prefix + "_rows"]
    rows = torch.where(rows >= 0, rows, num_rows).long()
    index = (rows, sampling[prefix + "_token_ids"].long())
    dtype = torch.bool if values is None else values.dtype
    out = torch.zeros(num_rows + 1, vocab, dtype=dtype, device=rows.device)
    if values is None:  # ones on the device: a Python True is a host-to-device copy, which
        out.index_put_(index, torch.ones_like(rows, dtype=torch.bool))  # CUDA graphs refuse
    else:
        out.index_put_(index, values, accumulate=True)
    return out[:num_rows]


def process_logits(logits: torch.Tensor, sampling: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits [L, V] rows sample from: banned tokens at -inf, logit_bias added, then
    repetition, frequency and presence penalties (vLLM's definitions). Inputs the layout lacks
    are skipped."""
    num_rows, vocab = logits.shape
    if "banned_rows" in sampling:
        logits = logits.masked_fill(_scatter(sampling, "banned", num_rows, vocab), float("-inf"))
    if "bias_rows" in sampling:
        logits = logits + _scatter(sampling, "bias", num_rows, vocab, sampling["logit_bias"])
    if "penalty_rows" in sampling:
        # [L, V]: output occurrences, and whether a token is in the prompt or the output
        counts = _scatter(sampling, "penalty", num_rows, vocab, sampling["penalty_counts"])
        seen = _scatter(sampling, "penalty", num_rows, vocab)
        penalty = torch.where(seen, sampling["repetition_penalty"][:, None], 1.0)  # [L, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits - sampling["frequency_penalty"][:, None] * counts
        logits = logits - sampling["presence_penalty"][:, None] * (counts > 0)
    return logits


def sample(logits: torch.Tensor, sampling: dict[str, torch.Tensor], *, num_top_logprobs: int,
           all_greedy: bool, use_filters: bool) -> tuple[torch.Tensor | None, ...]:
    """logits [L, V] float32 → token ids [L], then gather_logprobs' (logprobs [L], top ids
    [L, N], top logprobs [L, N], ranks [L]): a StepOutput's first five fields.

    sampling: the SamplingMetadata arrays as tensors on logits' device (rng_seed / rng_step as
    int64 holding uint32 values).
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    logits = process_logits(logits, sampling)
    tokens = torch.argmax(logits, dim=-1).to(torch.int32)
    if not all_greedy:
        temperature = sampling["temperature"]
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if use_filters:
            scaled = filter_logits(scaled, sampling["top_k"], sampling["top_p"], sampling["min_p"])
        u = uniform(sampling["rng_seed"], sampling["rng_step"], logits.shape[-1])
        sampled = torch.argmax(scaled - torch.log(-torch.log(u)), dim=-1).to(torch.int32)
        tokens = torch.where(temperature > 0, sampled, tokens)
    return (tokens, *gather_logprobs(logprobs, tokens, num_top_logprobs))


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor,
                    num_top_logprobs: int) -> tuple[torch.Tensor | None, ...]:
    """logprobs [..., V], tokens [...] (-1 = none) → (token logprobs [...], top ids [..., N],
    top logprobs [..., N], ranks [...]); all but the first are None when N is 0.

    A token's rank is the number of tokens at least as likely (vLLM's): 1 = the most likely."""
    safe = tokens.clamp(min=0).long()[..., None]
    token_logprobs = torch.gather(logprobs, -1, safe)[..., 0]
    if num_top_logprobs == 0:
        return token_logprobs, None, None, None
    ranks = (logprobs >= token_logprobs[..., None]).sum(dim=-1, dtype=torch.int32)
    top_lps, top_ids = torch.topk(logprobs, num_top_logprobs, dim=-1)
    return token_logprobs, top_ids.to(torch.int32), top_lps, ranks


def score_prompt_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """prompt_logprobs: logits [Pl, V] at prompt positions, token_ids [Pl] the prompt token
    after each → gather_logprobs' four, with the top MAX_LOGPROBS."""
    return gather_logprobs(torch.log_softmax(logits, dim=-1), token_ids, MAX_LOGPROBS)
