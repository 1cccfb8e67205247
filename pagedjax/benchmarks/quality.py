"""Quality as a number: the perplexity of a text under a model, from the engine's own prompt
logprobs (what quantized weights or caches cost: the ratio to the float32 model's)."""

from __future__ import annotations

import math


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(-mean log p(token | its prefix)) over every token of token_ids but the first."""
    from pagedjax import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    output = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    scored = [entry[token].logprob for entry, token in
              zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)]
    return math.exp(-sum(scored) / len(scored))
