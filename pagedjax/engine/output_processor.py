"""OutputProcessor: the engine core's token ids → text, stop strings, logprobs and RequestOutputs
(vLLM's frontend OutputProcessor), in the frontend's process: in the server, the engine core's
GIL never waits for it.

Each completion's tokens arrive as the core sends them (every step for a request that streams
or checks stop strings or logprobs, else once at its end); they are detokenized incrementally,
a stop string ends the completion here (its text and tokens cut there) and goes back to the core
as a FinishSequence, and RequestOutputs are built as each request's `output_kind` asks
(everything so far, only what is new, or one output at the end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedjax.engine.core_messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishSequence,
    PromptLogprobs,
    SeqOutput,
)
from pagedjax.engine.detokenizer import IncrementalDetokenizer, find_stop_string, token_decoder
from pagedjax.outputs import (
    CompletionOutput,
    Logprob,
    Logprobs,
    RequestOutput,
)
from pagedjax.outputs import PromptLogprobs as PromptLogprobList
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class CompletionState:
    """One completion as the frontend has it."""

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: Logprobs | None  # per output token, when requested
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)  # output tokens
    num_detokenized: int = 0  # of token_ids
    # Ended by a stop token (EOS, stop_token_ids): its text is not output (vLLM's), unless
    # include_stop_str_in_output; it stays in token_ids
    stop_token_untexted: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # DELTA: what earlier outputs carried
    num_sent_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    every_step: bool  # its completions come every step (streams, stop strings, logprobs)
    completions: dict[int, CompletionState] = field(default_factory=dict)  # by index
    prompt_logprobs: PromptLogprobList | None = None  # filled as the prompt's chunks come
    prompt_logprobs_sent: bool = False  # DELTA: the first output carried them
    num_cached_tokens: int = 0
    aborted: bool = False  # its completions that never started will not

    @property
    def finished(self) -> bool:
        done = all(c.finish_reason is not None for c in self.completions.values())
        return done and (self.aborted or len(self.completions) == self.params.n)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = token_decoder(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self._decoded: dict[int, str | None] = {}  # token id → its text alone
        self.detokenize_seconds = 0.0  # spent turning tokens into text, in all

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        params = request.params
        every_step = (params.output_kind is not RequestOutputKind.FINAL_ONLY
                      or bool(params.stop_strings) or params.logprobs is not None)
        state = RequestState(request.request_id, prompt, list(request.prompt_token_ids),
                             params, every_step)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first token has no prefix to score it
        self.requests[request.request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _completion(self, state: RequestState, index: int) -> CompletionState:
        completion = state.completions.get(index)
        if completion is None:
            want = state.params.logprobs is not None
            completion = state.completions[index] = CompletionState(
                index, IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                              state.params.skip_special_tokens, self._decode),
                logprobs=[] if want else None, cumulative_logprob=0.0 if want else None)
        return completion

    # ---- one step ----------------------------------------------------------------------------

    def process(self, outputs: EngineCoreOutputs
                ) -> tuple[list[RequestOutput], list[FinishSequence]]:
        """The outputs due from a step of the engine core, and the completions whose stop
        string it found (the core must end them there)."""
        for prompt_logprobs in outputs.prompt_logprobs:
            self._add_prompt_logprobs(prompt_logprobs)
        finishes: list[FinishSequence] = []
        due: dict[str, RequestState] = {}
        for out in outputs.outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            completion = self._completion(state, out.index)
            due[out.request_id] = state
            if completion.finish_reason is not None:
                continue  # ended here (a stop string) before the core knew
            if out.index == 0 and out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            self._take(state, completion, out, finishes)
        results = []
        for output in outputs.request_outputs:  # whole (beam search)
            state = self.requests.pop(output.request_id, None)
            if state is not None:
                output.prompt = state.prompt
                results.append(output)
        for state in due.values():
            finished = state.finished
            if finished:
                del self.requests[state.request_id]
            if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                results.append(self._request_output(state, finished))
        return results, finishes

    def _take(self, state: RequestState, completion: CompletionState, out: SeqOutput,
              finishes: list[FinishSequence]) -> None:
        """A completion's new tokens: logprobs, text (every step: stop strings), the end."""
        completion.token_ids += out.new_token_ids
        if (isinstance(out.stop_reason, int) and out.finish_reason == "stop"
                and not state.params.include_stop_str_in_output):
            completion.stop_token_untexted = True
        if out.logprobs is not None:
            self._add_logprobs(completion, out)
        if out.finish_reason == "abort":
            state.aborted = True
        if state.every_step:
            stop = self._detokenize(state, completion)
            if stop is not None:
                finishes.append(FinishSequence(state.request_id, completion.index,
                                               len(completion.token_ids), stop))
                return
        if out.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason

    def _detokenize(self, state: RequestState, completion: CompletionState) -> str | None:
        """The text of the completion's new tokens; with stop strings, one token at a time
        (a stop may end at any of them): the stop string it ends at, the completion cut
        there, or None."""
        start = completion.num_detokenized
        new_tokens = completion.token_ids[start : _text_end(completion)]
        completion.num_detokenized = len(completion.token_ids)
        params, detokenizer = state.params, completion.detokenizer
        start_time = time.perf_counter()
        try:
            if not params.stop_strings:
                detokenizer.append(new_tokens)
                return None
            longest = max(map(len, params.stop_strings))
            for j, token in enumerate(new_tokens):
                delta = detokenizer.append([token])
                if not delta:
                    continue
                window = detokenizer.tail(len(delta) + longest - 1)
                hit = find_stop_string(window, len(delta), params.stop_strings,
                                       params.include_stop_str_in_output)
                if hit is not None:
                    stop, cut = hit
                    detokenizer.truncate(detokenizer.num_chars - len(window) + cut)
                    num_output = start + j + 1
                    del completion.token_ids[num_output:]
                    completion.num_detokenized = num_output
                    if completion.logprobs is not None:
                        del completion.logprobs[num_output:]
                    completion.finish_reason, completion.stop_reason = "stop", stop
                    return stop
            return None
        finally:
            self.detokenize_seconds += time.perf_counter() - start_time

    def _decode_token(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token not in self._decoded:
            self._decoded[token] = self.tokenizer.decode([token])
        return self._decoded[token]

    def _logprob_dict(self, token: int, logprob: float, rank: int | None, top_ids: list[int],
                      top_logprobs: list[float]) -> dict[int, Logprob]:
        """The token's Logprob first, then the top ones (ranks 1..N), as vLLM orders them."""
        top = {tid: Logprob(lp, r, self._decode_token(tid))
               for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1)}
        return {token: Logprob(logprob, rank, self._decode_token(token)), **top}

    def _add_logprobs(self, completion: CompletionState, out: SeqOutput) -> None:
        """Each new token's logprob and rank (computed on the device) plus the top ones."""
        lps = out.logprobs
        for j, token in enumerate(out.new_token_ids):
            entry = self._logprob_dict(token, lps.logprobs[j],
                                       None if lps.ranks is None else lps.ranks[j],
                                       lps.top_ids[j], lps.top_logprobs[j])
            completion.logprobs.append(entry)
            completion.cumulative_logprob += lps.logprobs[j]

    def _add_prompt_logprobs(self, prompt: PromptLogprobs) -> None:
        """Scored prompt tokens into their request's prompt_logprobs, by position: one scored
        again (its prompt recomputed after a preemption) is kept as first computed."""
        state = self.requests.get(prompt.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        scored = state.prompt_logprobs
        for j, position in enumerate(range(prompt.first_position,
                                           prompt.first_position + len(prompt.logprobs))):
            if position == len(scored):
                scored.append(self._logprob_dict(
                    state.prompt_token_ids[position], prompt.logprobs[j], prompt.ranks[j],
                    prompt.top_ids[j], prompt.top_logprobs[j]))

    # ---- outputs -----------------------------------------------------------------------------

    def _request_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind is RequestOutputKind.DELTA
        stops = state.params.stop_strings
        # DELTA text stops short of where a stop string could still begin (cut later)
        hold_back = max(map(len, stops)) - 1 if delta and stops else 0
        outputs = [self._completion_output(state.completions[i], delta, hold_back)
                   for i in sorted(state.completions)]
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None  # DELTA: only the first output carries them
        state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs,
                             finished=finished, num_cached_tokens=state.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    def _completion_output(self, completion: CompletionState, delta: bool,
                           hold_back: int = 0) -> CompletionOutput:
        detokenizer = completion.detokenizer
        if completion.num_detokenized < len(completion.token_ids):  # sent at its end
            start_time = time.perf_counter()
            detokenizer.append(completion.token_ids[completion.num_detokenized :
                                                    _text_end(completion)])
            completion.num_detokenized = len(completion.token_ids)
            self.detokenize_seconds += time.perf_counter() - start_time
        logprobs = completion.logprobs
        finished = completion.finish_reason is not None
        if delta:  # O(new) work: only what earlier outputs did not carry
            sendable = detokenizer.num_chars - (0 if finished else hold_back)
            num_new_chars = max(sendable - completion.num_sent_chars, 0)
            end = detokenizer.num_chars - sendable
            text = detokenizer.tail(num_new_chars + end)[: num_new_chars]
            token_ids = completion.token_ids[completion.num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[completion.num_sent_tokens :]
            completion.num_sent_tokens = len(completion.token_ids)
            completion.num_sent_chars += num_new_chars
        else:
            text, token_ids = detokenizer.output_text, list(completion.token_ids)
            logprobs = None if logprobs is None else list(logprobs)
        return CompletionOutput(
            index=completion.index, text=text, token_ids=token_ids,
            cumulative_logprob=completion.cumulative_logprob, logprobs=logprobs,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)


def _text_end(completion: CompletionState) -> int:
    """Where a completion's text ends in its token_ids (before a stop token)."""
    return len(completion.token_ids) - completion.stop_token_untexted
