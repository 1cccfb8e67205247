"""On-device sampling for the torch runner: the semantics of backends/jax/sampler.py, op for op.

Order (vLLM's): raw logprobs (returned) → banned tokens (min_tokens) → logit_bias → repetition,
frequency and presence penalties → the grammar's token bitmask (structured outputs) → greedy
rows take the argmax; random rows divide by
temperature, keep top-k, then top-p, then min-p, and take the argmax of logits + Gumbel noise
from pagedjax.rng's counters (an exact categorical sample), so a seeded request samples the
same tokens on either backend.
"""

from __future__ import annotations

import torch

from pagedjax import rng as prng
from pagedjax.core.batch import StepFlags
from pagedjax.core.logit_entries import EntryFlag
from pagedjax.kernels_cuda import ops_backend
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
    return uniform_at(seed, step, torch.arange(num, dtype=torch.int64, device=seed.device))


def uniform_at(seed: torch.Tensor, step: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """uniform(seed, step, num)[:, index] without the other columns: index [N] → [L, N]."""
    key = _mix32(seed[:, None] ^ _mix32((step[:, None] * prng.GOLDEN) & _MASK32))
    stream = (index * prng.STREAM) & _MASK32
    bits = _mix32((key + stream[None, :]) & _MASK32)  # [L, N]
    return bits_to_uniform(bits)


def gumbel_argmax(x: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """argmax(x - log(-log(uniform(seed, step, V)))) → [L] int32: a categorical sample from
    softmax(x [L, V]). On CPU in float32 the C++ op (one pass a row; these torch ops write and
    read [L, V] int64 arrays ~15 times, a millisecond a row of a 49k vocabulary)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and ops_backend() != "reference":
        return torch.ops.pagedjax.gumbel_argmax(x.contiguous(), seed, step)
    u = uniform(seed, step, x.shape[-1])
    return torch.argmax(x - torch.log(-torch.log(u)), dim=-1).to(torch.int32)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """uint32 hashes (in int64) → float32 uniforms strictly inside (0, 1) (pagedjax.rng's)."""
    top = (bits >> (32 - prng.UNIFORM_BITS)).to(torch.float32)
    return (top + 0.5) * (2.0**-prng.UNIFORM_BITS)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p, then min-p drop. logits [L, V]; knobs [L]. On CPU in
    float32 the C++ op (the JAX backend's filter too: the same kernel)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32
            and ops_backend() != "reference"):
        return torch.ops.pagedjax.filter_logits(logits.contiguous(), top_k.to(torch.int32),
                                                top_p.to(torch.float32),
                                                min_p.to(torch.float32))
    return filter_logits_sorted(logits, top_k, top_p, min_p)


def filter_logits_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         min_p: torch.Tensor) -> torch.Tensor:
    """filter_logits by sorting each row: the definition (filter_cpu_kernel.h states it)."""
    vocab = logits.shape[-1]
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values  # [L, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [L]
    in_top_k = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]
    probs = torch.softmax(sorted_desc.masked_fill(~in_top_k, float("-inf")), dim=-1)
    keep = in_top_k & ((torch.cumsum(probs, dim=-1) - probs < top_p[:, None])
                       | (top_p[:, None] >= 1.0))
    # [L]: >= 1 for a request's knobs; padding rows (top_p 0) keep 0 and read column 0
    num_kept = keep.sum(dim=-1).clamp(min=1)
    threshold = torch.gather(sorted_desc, 1, (num_kept - 1)[:, None])[:, 0]
    min_p_threshold = torch.where(min_p > 0, sorted_desc[:, 0] + torch.log(min_p),
                                  float("-inf"))
    threshold = torch.maximum(threshold, min_p_threshold)
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))


def apply_logit_entries(logits: torch.Tensor, entries: tuple[torch.Tensor, torch.Tensor],
                        sampling: dict[str, torch.Tensor]) -> torch.Tensor:
    """logits [R, V] with the (row, token) entries of logit_entries.py applied (the JAX
    sampler's apply_logit_entries, op for op). entries: (ints [4, E] = rows (-1 pads), tokens,
    output counts, flags; bias [E]); sampling: the penalty knobs [R]."""
    ints, bias = entries
    rows, tokens, counts, flags = ints[0].long(), ints[1].long(), ints[2], ints[3]
    num_rows = logits.shape[0]
    valid = rows >= 0
    safe_rows = torch.where(valid, rows, 0)
    x = logits[safe_rows, tokens]  # [E]
    x = x.masked_fill(flags & EntryFlag.BANNED != 0, float("-inf"))
    x = x + bias
    penalty = sampling["repetition_penalty"][safe_rows]
    x = torch.where(flags & EntryFlag.SEEN != 0, torch.where(x > 0, x / penalty, x * penalty), x)
    x = x - sampling["frequency_penalty"][safe_rows] * counts
    x = x - sampling["presence_penalty"][safe_rows] * (counts > 0)
    # padding entries land in an extra row that is cut off (no data-dependent shape)
    out = torch.cat([logits, logits.new_zeros(1, logits.shape[1])])
    out[torch.where(valid, rows, num_rows), tokens] = x
    return out[:num_rows]


_NEG_INF_BITS = -8388608  # 0xFF800000 as int32: the bits of float32 -inf


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [R, V] at -inf where bitmask [R, ceil(V / 32)] int32 has the token's bit (t % 32
    of word t // 32) clear: what a row's grammar forbids (the JAX sampler's `where`); and the
    masked rows' argmax [R] int32 where the pass gave it (None: not computed).

    On CPU in float32 one C++ pass (token_mask_cpu_kernel.h) writes the masked rows and finds
    their argmax. Elsewhere, branch-free: a bit b becomes the float32 whose bits are
    (b - 1) & 0xFF800000 (0.0 or -inf), added to the logits (a masked_fill over a grammar's
    scattered bits runs branch by branch on a CPU)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and ops_backend() != "reference"):
        return torch.ops.pagedjax.apply_token_bitmask(logits.contiguous(),
                                                      bitmask.to(torch.int32).contiguous())
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bias = (bitmask[:, :, None] >> shifts).bitwise_and_(1).sub_(1).bitwise_and_(_NEG_INF_BITS)
    bias = bias.view(torch.float32).reshape(bitmask.shape[0], -1)  # [R, 32 W]: 0.0 or -inf
    return logits + bias[:, : logits.shape[-1]], None


def process_logits(logits: torch.Tensor, sampling: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits [R, V] rows sample from: the logit entries, then the token bitmask applied,
    where the step has any (sampling["entries"], sampling["token_bitmask"]); and their argmax
    [R] int32 where the mask's pass gave it (else None)."""
    entries, bitmask = sampling.get("entries"), sampling.get("token_bitmask")
    if entries is not None:
        logits = apply_logit_entries(logits, entries, sampling)
    return (logits, None) if bitmask is None else apply_token_bitmask(logits, bitmask)


def logits_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [L, V] → (argmax [L] int32, log-sum-exp [L]): the greedy token, and what turns
    any logit into its logprob (logprob = logit - lse), without writing out [L, V] logprobs. On
    CPU in float32 one C++ pass per row (logits_cpu_kernel.h; the JAX backend's too)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and ops_backend() != "reference"):
        return torch.ops.pagedjax.logits_stats(logits.contiguous())
    return torch.argmax(logits, dim=-1).to(torch.int32), torch.logsumexp(logits, dim=-1)


def sample(logits: torch.Tensor, sampling: dict[str, torch.Tensor], flags: StepFlags
           ) -> tuple[torch.Tensor | None, ...]:
    """logits [L, V] float32 → token ids [L], then gather_logprobs' (logprobs [L], top ids
    [L, N], top logprobs [L, N], ranks [L]): a StepOutput's first five fields.

    sampling: the knobs as tensors on logits' device (rng_seed / rng_step as int64 holding
    uint32 values), and "entries" when the step has logit entries; flags: what the step's rows
    use (the host's copy): the rest is skipped. A greedy step without logit entries or a token
    mask reads the logits once (logits_stats).
    """
    all_greedy, use_filters = not flags.sampled, flags.filters
    num_top_logprobs = MAX_LOGPROBS if flags.logprobs else 0
    tokens, lse = logits_stats(logits)  # logprobs are the raw model's
    raw, (logits, processed_argmax) = logits, process_logits(logits, sampling)
    if logits is not raw:
        tokens = (processed_argmax if processed_argmax is not None
                  else torch.argmax(logits, dim=-1).to(torch.int32))
    if not all_greedy:
        temperature = sampling["temperature"]
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if use_filters:
            scaled = filter_logits(scaled, sampling["top_k"], sampling["top_p"], sampling["min_p"])
        sampled = gumbel_argmax(scaled, sampling["rng_seed"], sampling["rng_step"])
        tokens = torch.where(temperature > 0, sampled, tokens)
    return (tokens, *gather_logprobs(raw, lse, tokens, num_top_logprobs))


def gather_logprobs(logits: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor,
                    num_top_logprobs: int) -> tuple[torch.Tensor | None, ...]:
    """logits [..., V] with their log-sum-exp [...], tokens [...] (-1 = none) → (token logprobs
    [...], top ids [..., N], top logprobs [..., N], ranks [...]); all but the first are None
    when N is 0.

    A token's rank is the number of tokens at least as likely (vLLM's): 1 = the most likely."""
    safe = tokens.clamp(min=0).long()[..., None]
    token_logits = torch.gather(logits, -1, safe)[..., 0]
    if num_top_logprobs == 0:
        return token_logits - lse, None, None, None
    ranks = (logits >= token_logits[..., None]).sum(dim=-1, dtype=torch.int32)
    top_logits, top_ids = torch.topk(logits, num_top_logprobs, dim=-1)
    return token_logits - lse, top_ids.to(torch.int32), top_logits - lse[..., None], ranks


def score_prompt_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """prompt_logprobs: logits [Pl, V] at prompt positions, token_ids [Pl] the prompt token
    after each → gather_logprobs' four, with the top MAX_LOGPROBS."""
    return gather_logprobs(logits, torch.logsumexp(logits, dim=-1), token_ids, MAX_LOGPROBS)
