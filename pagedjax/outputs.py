"""RequestOutput / CompletionOutput, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability at one position, as vLLM's."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token; None where it was not computed
    decoded_token: str | None = None


# One generated position: token id -> Logprob (the sampled token plus the top-N).
Logprobs = list[dict[int, Logprob]]
# One per prompt token: the token plus the top-N given its prefix; None for the first (vLLM's).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Logprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # LLM.chat with a reasoning parser (LLM(reasoning_parser=...)): text split into the
    # reasoning and the answer after it (the server's reasoning_content and content)
    reasoning_content: str | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, and what the engine streams per step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs
