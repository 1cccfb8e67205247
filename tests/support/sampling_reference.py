"""NumPy references for the sampling parameters that change the logits or read the prompt.

`reference_logits` is vLLM's definition, one row at a time and written for reading: banned
tokens to -inf, logit_bias added, then repetition_penalty on every token seen in the prompt or
the output (positive logits divided, negative ones multiplied), then frequency_penalty times
each output token's count and presence_penalty once per output token present.
`ReferenceLogitsProcessor` runs it inside HF `generate`, and `hf_logprobs` scores every position
of a token sequence with one full HF forward: the oracles for the engine tests.
"""

from __future__ import annotations

import numpy as np

from pagedjax.sampling_params import SamplingParams


def reference_logits(logits: np.ndarray, params: SamplingParams, prompt: list[int],
                     output: list[int], banned: list[int] = ()) -> np.ndarray:
    """logits [V] float32 → the logits the row samples from [V] float32."""
    out = np.array(logits, np.float32)
    out[list(banned)] = -np.inf
    for token, bias in (params.logit_bias or {}).items():
        out[token] += np.float32(bias)
    counts = np.bincount(np.asarray(output, np.int64), minlength=out.size)
    seen = counts > 0
    seen[list(prompt)] = True
    penalty = np.float32(params.repetition_penalty)
    out = np.where(seen, np.where(out > 0, out / penalty, out * penalty), out)
    out = out - np.float32(params.frequency_penalty) * counts.astype(np.float32)
    out = out - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)
    return out.astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """[..., V] → log-probabilities, in float64 (a reference, not a twin)."""
    x = np.asarray(x, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def reference_rank(logprobs: np.ndarray, token: int) -> int:
    """Where token sorts among logprobs [V], most likely first (1-based, by NumPy's argsort)."""
    order = np.argsort(-np.asarray(logprobs), kind="stable")
    return int(np.nonzero(order == token)[0][0]) + 1


class ReferenceLogitsProcessor:
    """An HF `LogitsProcessor` (batch 1) applying reference_logits to each generated position."""

    def __init__(self, params: SamplingParams, prompt_len: int) -> None:
        self.params, self.prompt_len = params, prompt_len

    def __call__(self, input_ids, scores):
        import torch

        ids = input_ids[0].tolist()
        out = reference_logits(scores[0].numpy(), self.params, ids[: self.prompt_len],
                               ids[self.prompt_len :])
        return torch.from_numpy(out)[None]


def hf_generate_with_reference(model_dir: str, prompt: list[int], params: SamplingParams,
                               max_new_tokens: int) -> list[int]:
    """HF greedy generation (EOS ignored) with the reference processing of `params`."""
    import torch
    from transformers import LogitsProcessorList

    from tests.support.hf_reference import _hf_model

    processor = LogitsProcessorList([ReferenceLogitsProcessor(params, len(prompt))])
    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            logits_processor=processor)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), V] float64: row i is the distribution of token i + 1 given tokens ..i,
    from one full forward of the HF model."""
    import torch

    from tests.support.hf_reference import _hf_model

    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([token_ids])).logits[0]
    return log_softmax(logits.numpy())
