"""OutputProcessor: token ids from the scheduler → text, stop strings, logprobs and outputs.

Off the scheduler's path: it detokenizes each completion's new tokens incrementally, finishes a
completion through the scheduler when a stop string appears (cutting the tokens after it), keeps
logprobs, and builds RequestOutputs as each request's `output_kind` asks (everything so far, only
what is new, or one output at the end). Work per step is proportional to what users asked for:
a request that wants one output at the end (FINAL_ONLY: the offline LLM's) with no stop strings
and no logprobs is detokenized once, when it finishes, in one call; the others every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedjax.core.batch import ModelOutput, PromptLogprobsOutput
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.sequence import Sequence, SequenceStatus
from pagedjax.engine.detokenizer import IncrementalDetokenizer, find_stop_string, token_decoder
from pagedjax.outputs import CompletionOutput, Logprob, Logprobs, PromptLogprobs, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class CompletionState:
    """What one completion has produced so far beyond its token ids."""

    detokenizer: IncrementalDetokenizer
    logprobs: Logprobs | None  # per output token, when requested
    cumulative_logprob: float | None
    num_processed: int = 0  # output tokens seen
    num_sent_tokens: int = 0  # DELTA: what earlier outputs carried
    num_sent_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[int, Sequence] = field(default_factory=dict)  # by completion index
    completions: dict[int, CompletionState] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # filled as the prompt's chunks are computed
    prompt_logprobs_sent: bool = False  # DELTA: the first output carried them

    @property
    def finished(self) -> bool:
        return (len(self.seqs) == self.params.n
                and all(s.is_finished for s in self.seqs.values()))


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self._decode = token_decoder(tokenizer)
        self.scheduler = scheduler
        self.requests: dict[str, RequestState] = {}
        # requests whose completions are processed every step (streams, stop strings,
        # logprobs); the others only when a completion finishes
        self._per_step: set[str] = set()
        self._decoded: dict[int, str | None] = {}  # token id → its text alone
        self.detokenize_seconds = 0.0  # spent turning tokens into text, in all

    def add_request(self, request_id: str, prompt: str | None, seq: Sequence) -> None:
        params = seq.sampling_params
        state = RequestState(request_id, prompt, list(seq.token_ids), params)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first token has no prefix to score it
        self.requests[request_id] = state
        if (params.output_kind is not RequestOutputKind.FINAL_ONLY or params.stop_strings
                or params.logprobs is not None):
            self._per_step.add(request_id)
        self._track(state, seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request now (finish_reason "abort", blocks freed) and forget it; its final
        output, or None for an unknown id."""
        state = self.remove_request(request_id)
        return None if state is None else self._request_output(state, finished=True)

    def remove_request(self, request_id: str) -> RequestState | None:
        """Forget the request, finishing ("abort") and freeing any sequence still running."""
        state = self.requests.pop(request_id, None)
        self._per_step.discard(request_id)
        for seq in () if state is None else state.seqs.values():
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self.scheduler.remove(seq)
        return state

    def add_fork(self, seq: Sequence) -> None:
        """Track a sibling its request forked (n > 1), from then on."""
        state = self.requests.get(seq.request_id)
        if state is not None and seq.index not in state.seqs:
            self._track(state, seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _track(self, state: RequestState, seq: Sequence) -> None:
        params = state.params
        state.seqs[seq.index] = seq
        want = params.logprobs is not None
        state.completions[seq.index] = CompletionState(
            IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                   params.skip_special_tokens, self._decode),
            logprobs=[] if want else None, cumulative_logprob=0.0 if want else None)

    # ---- one step ----------------------------------------------------------------------------

    def process(self, touched: list[Sequence], output: ModelOutput) -> list[RequestOutput]:
        """Take the step's new tokens of each touched sequence whose request wants them now
        (every step, or at its end); return the outputs due."""
        if output.prompt_logprobs is not None:
            self._add_prompt_logprobs(output.prompt_logprobs)
        per_step, finished_status = self._per_step, SequenceStatus.FINISHED
        due = [seq for seq in touched
               if seq.status is finished_status or seq.request_id in per_step]
        if not due:
            return []
        rows = None
        if output.sampled_logprobs is not None and any(
                s.sampling_params.logprobs is not None for s in due):
            rows = {seq_id: r for r, seq_id in enumerate(output.seq_ids)}
        requests: dict[str, RequestState] = {}
        for seq in due:
            state = self.requests[seq.request_id]
            if seq.index not in state.seqs:  # a sibling forked since
                self._track(state, seq)
            self._process_seq(state, seq, output, rows[seq.seq_id] if rows else -1)
            requests[seq.request_id] = state
        outputs = []
        for state in requests.values():
            finished = state.finished
            if finished:
                del self.requests[state.request_id]
                self._per_step.discard(state.request_id)
                for seq in state.seqs.values():
                    self.scheduler.remove(seq)
            if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._request_output(state, finished))
        return outputs

    def _process_seq(self, state: RequestState, seq: Sequence, output: ModelOutput,
                     row: int) -> None:
        completion, params = state.completions[seq.index], state.params
        start = seq.num_prompt_tokens + completion.num_processed
        new_tokens = seq.token_ids[start:]
        completion.num_processed += len(new_tokens)
        if completion.logprobs is not None:
            self._add_logprobs(completion, output, row, new_tokens, params.logprobs)
        detokenizer = completion.detokenizer
        start_time = time.perf_counter()
        if not params.stop_strings:
            detokenizer.append(new_tokens)
            self.detokenize_seconds += time.perf_counter() - start_time
            return
        self._find_stop_string(state, seq, completion, new_tokens)
        self.detokenize_seconds += time.perf_counter() - start_time

    def _find_stop_string(self, state: RequestState, seq: Sequence,
                          completion: CompletionState, new_tokens: list[int]) -> None:
        """Detokenize one token at a time: a stop string may end at any of them."""
        params, detokenizer = state.params, completion.detokenizer
        longest = max(map(len, params.stop_strings))
        for j, token in enumerate(new_tokens):  # one at a time: the stop may end at any token
            delta = detokenizer.append([token])
            if not delta:
                continue
            window = detokenizer.tail(len(delta) + longest - 1)
            hit = find_stop_string(window, len(delta), params.stop_strings,
                                   params.include_stop_str_in_output)
            if hit is not None:
                stop, cut = hit
                detokenizer.truncate(detokenizer.num_chars - len(window) + cut)
                num_output = completion.num_processed - len(new_tokens) + j + 1
                self.scheduler.finish(seq, "stop", stop, num_output_tokens=num_output)
                completion.num_processed = num_output
                if completion.logprobs is not None:
                    del completion.logprobs[num_output:]
                return

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

    def _add_logprobs(self, completion: CompletionState, output: ModelOutput, row: int,
                      tokens: list[int], num_top: int) -> None:
        """Each new token's logprob and rank (computed on the device) plus the top num_top."""
        token_lps = output.sampled_logprobs[row].tolist()
        ranks = None if output.sampled_ranks is None else output.sampled_ranks[row].tolist()
        has_top = num_top and output.top_logprob_ids is not None
        for j, token in enumerate(tokens):
            top_ids = output.top_logprob_ids[row, j, :num_top].tolist() if has_top else []
            top_lps = output.top_logprobs[row, j, :num_top].tolist() if has_top else []
            entry = self._logprob_dict(token, token_lps[j], None if ranks is None else ranks[j],
                                       top_ids, top_lps)
            completion.logprobs.append(entry)
            completion.cumulative_logprob += token_lps[j]

    def _add_prompt_logprobs(self, prompt: PromptLogprobsOutput) -> None:
        """Scored prompt tokens into their requests' prompt_logprobs, by position: one scored
        again (its prompt recomputed after a preemption) is kept as first computed."""
        lps, ranks = prompt.logprobs.tolist(), prompt.ranks.tolist()
        first_row = 0
        for seq_id, first_position, count in prompt.rows:
            seq = self.scheduler.seqs.get(seq_id)
            state = None if seq is None else self.requests.get(seq.request_id)
            rows = range(first_row, first_row + count)
            first_row += count
            if state is None or state.prompt_logprobs is None:
                continue
            num_top, scored = state.params.prompt_logprobs, state.prompt_logprobs
            for row, position in zip(rows, range(first_position, first_position + count)):
                if position == len(scored):
                    scored.append(self._logprob_dict(
                        state.prompt_token_ids[position], lps[row], ranks[row],
                        prompt.top_ids[row, :num_top].tolist(),
                        prompt.top_logprobs[row, :num_top].tolist()))

    # ---- outputs -----------------------------------------------------------------------------

    def _request_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind is RequestOutputKind.DELTA
        stops = state.params.stop_strings
        # DELTA text stops short of where a stop string could still begin (cut later)
        hold_back = max(map(len, stops)) - 1 if delta and stops else 0
        outputs = [self._completion_output(state.seqs[i], state.completions[i], delta, hold_back)
                   for i in sorted(state.seqs)]
        first = state.seqs[0]
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None  # DELTA: only the first output carries them
        state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs,
                             finished=finished, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    def _completion_output(self, seq: Sequence, completion: CompletionState, delta: bool,
                           hold_back: int = 0) -> CompletionOutput:
        detokenizer, start = completion.detokenizer, seq.num_prompt_tokens
        pending = seq.num_output_tokens - completion.num_processed
        if pending > 0:  # not processed as it came (one output at the end, or an abort)
            start_time = time.perf_counter()
            detokenizer.append(seq.token_ids[-pending:])
            self.detokenize_seconds += time.perf_counter() - start_time
            completion.num_processed += pending
        logprobs = completion.logprobs
        if delta:  # O(new) work: only what earlier outputs did not carry
            sendable = detokenizer.num_chars - (0 if seq.is_finished else hold_back)
            num_new_chars = max(sendable - completion.num_sent_chars, 0)
            end = detokenizer.num_chars - sendable
            text = detokenizer.tail(num_new_chars + end)[: num_new_chars]
            token_ids = seq.token_ids[start + completion.num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[completion.num_sent_tokens :]
            completion.num_sent_tokens = seq.num_output_tokens
            completion.num_sent_chars += num_new_chars
        else:
            text, token_ids = detokenizer.output_text, seq.token_ids[start:]
            logprobs = None if logprobs is None else list(logprobs)
        return CompletionOutput(
            index=seq.index, text=text, token_ids=token_ids,
            cumulative_logprob=completion.cumulative_logprob, logprobs=logprobs,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
