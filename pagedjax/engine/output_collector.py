"""RequestOutputCollector: one request's outputs between AsyncLLM's engine loop and its consumer.

The engine loop always asks the engine for DELTA outputs (so every step's new tokens can be timed);
here they merge while the consumer is behind, so a slow client never makes a queue grow, and the
consumer gets the kind it asked for: only what is new (DELTA), everything so far (CUMULATIVE), or
one output at the end (FINAL_ONLY). Runs on the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import RequestOutputKind


class RequestOutputCollector:
    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._total: RequestOutput | None = None  # CUMULATIVE / FINAL_ONLY: everything so far
        self._ready: RequestOutput | BaseException | None = None  # what get() returns next
        self._event = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        """Take one DELTA output from the engine (or an error that ends the request)."""
        if isinstance(output, BaseException):
            self._ready = output
        elif self.output_kind is RequestOutputKind.DELTA:
            ready = self._ready
            self._ready = output if ready is None else merge_delta(ready, output)
        else:
            self._total = output if self._total is None else merge_delta(self._total, output)
            if self.output_kind is RequestOutputKind.FINAL_ONLY and not output.finished:
                return
            self._ready = _copy(self._total)
        self._event.set()

    async def get(self) -> RequestOutput:
        """The next output (merged with any that came since the last call)."""
        while self._ready is None:
            self._event.clear()
            await self._event.wait()
        ready, self._ready = self._ready, None
        if isinstance(ready, BaseException):
            raise ready
        return ready


def merge_delta(into: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """Append a later DELTA output to `into` (which the merge owns and changes)."""
    by_index = {c.index: c for c in into.outputs}
    for new in delta.outputs:
        old = by_index.get(new.index)
        if old is None:
            into.outputs.append(new)
            continue
        old.text += new.text
        old.token_ids = old.token_ids + new.token_ids
        if new.logprobs is not None:
            old.logprobs = (old.logprobs or []) + new.logprobs
        old.cumulative_logprob = new.cumulative_logprob
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = delta.finished
    into.num_cached_tokens = delta.num_cached_tokens
    return into


def _copy(output: RequestOutput) -> RequestOutput:
    """A snapshot the consumer may keep while later deltas extend the original."""
    outputs = [CompletionOutput(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
               for c in output.outputs]
    return dataclasses.replace(output, outputs=outputs)
