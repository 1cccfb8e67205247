"""What crosses between the frontend (input and output processing, the server) and the engine
core (scheduler, batch, runner), in vLLM's names: msgspec structs, so that the same objects
serve in one process and travel between two (core_client.py) at msgpack speed.

A request arrives validated and tokenized (InputProcessor). Each step the core sends, for every
completion whose request wants its tokens now, the tokens it got since the last time: every
step for a request that streams or checks stop strings or logprobs, else once, when it
finishes. The frontend detokenizes them; a stop string it finds comes back as a FinishSequence.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # a beam search's: what its beams sample with
    max_tokens: int  # params.max_tokens, or what max_model_len leaves
    beam_params: BeamSearchParams | None = None
    grammar: str | None = None  # structured outputs: the llguidance grammar


class FinishSequence(msgspec.Struct, array_like=True):
    """The frontend found a stop string: the completion ends after num_output_tokens."""

    request_id: str
    index: int
    num_output_tokens: int
    stop_reason: str


class SeqLogprobs(msgspec.Struct, array_like=True):
    """Per new token: its logprob under the raw model, its rank, and the top ones."""

    logprobs: list[float]
    ranks: list[int] | None
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class SeqOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one completion (its index among the request's n)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # of the prompt, from the prefix cache (the first output)
    logprobs: SeqLogprobs | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Prompt tokens scored this step, from prompt position `first_position` on."""

    request_id: str
    first_position: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's outputs (or none: the core answering a utility call, or idle)."""

    outputs: list[SeqOutput] = msgspec.field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = msgspec.field(default_factory=list)
    # whole outputs the core built itself (a beam search's, its policy picks the beams)
    request_outputs: list[RequestOutput] = msgspec.field(default_factory=list)
    metrics: dict[str, Any] | None = None  # the core's get_metrics(), now and then

    @property
    def empty(self) -> bool:
        return not (self.outputs or self.prompt_logprobs or self.request_outputs)
