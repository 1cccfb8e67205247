"""AsyncLLM: the engine for asyncio code (the OpenAI server), under vLLM's names.

One engine loop thread owns the LLMEngine: it steps while requests exist and sleeps otherwise.
Other threads only add and abort through the engine's inbox, which step() drains first. Each
request has a RequestOutputCollector on its caller's event loop; the loop thread hands it every
step's DELTA output, records timings and feeds the stat loggers.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from pagedjax.config import EngineConfig
from pagedjax.engine.llm_engine import LLMEngine, PromptType
from pagedjax.engine.output_collector import RequestOutputCollector
from pagedjax.engine.stat_loggers import LoggingStatLogger, StatLogger
from pagedjax.engine.stats import IterationStats, RequestTimes
from pagedjax.engine_args import EngineArgs
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.tokenizer import load_tokenizer

logger = logging.getLogger("pagedjax")

StatLoggerFactory = Callable[[EngineConfig], StatLogger]


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (vLLM's name): the same options."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step failed); no request can finish."""


@dataclass
class _Request:
    collector: RequestOutputCollector
    loop: asyncio.AbstractEventLoop
    times: RequestTimes


class AsyncLLM:
    """Serve requests from asyncio code over one LLMEngine driven by an engine loop thread.

    >>> llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model="path/to/checkpoint"))
    >>> async for output in llm.generate("def f(x):", SamplingParams(max_tokens=8), "r1"):
    ...     print(output.outputs[0].text)
    """

    def __init__(self, engine: LLMEngine, *, log_stats: bool = True,
                 stat_loggers: list[StatLoggerFactory] | None = None,
                 log_stats_interval: float = 10.0) -> None:
        """stat_loggers: factories (engine config → StatLogger), as vLLM's; log_stats adds the
        periodic log line, every log_stats_interval seconds."""
        self.engine = engine
        # The frontend's own tokenizer: the loop thread detokenizes with the engine's.
        self.tokenizer = load_tokenizer(engine.config.tokenizer or engine.config.model)
        self.stat_loggers = [factory(engine.config) for factory in stat_loggers or []]
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self.log_stats_interval = log_stats_interval
        self._requests: dict[str, _Request] = {}
        self._finished_early: deque[tuple[RequestTimes, float]] = deque()  # aborted in the inbox
        self._wakeup = threading.Event()
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.metrics = engine.get_metrics()  # replaced (never changed) by the engine loop
        for stat_logger in self.stat_loggers:
            stat_logger.record(self.metrics, IterationStats())
        self._thread = threading.Thread(target=self._run_engine_loop, daemon=True,
                                        name="pagedjax-engine-loop")
        self._thread.start()
        _LIVE.add(self)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Load the model (logging the load time, the KV cache size and the concurrency it
        allows) and start the engine loop. kwargs: AsyncLLM's (log_stats, stat_loggers, ...)."""
        start = time.perf_counter()
        engine = LLMEngine.from_engine_args(engine_args)
        config = engine.config
        num_tokens = engine.block_manager.num_blocks * config.block_size
        logger.info("Loaded %s (backend %s, %s) in %.1f s", config.model, config.backend,
                    config.dtype, time.perf_counter() - start)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; maximum concurrency for "
                    "%d tokens per request: %.2fx", engine.block_manager.num_blocks,
                    config.block_size, num_tokens, config.max_model_len,
                    num_tokens / config.max_model_len)
        return cls(engine, **kwargs)

    # ---- requests ----------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams) -> RequestOutputCollector:
        """Queue a request; its outputs arrive in the returned collector. Invalid input raises
        ValueError (or TypeError) here, and nothing is queued."""
        return self._add_request(request_id, prompt, sampling_params)

    def _add_request(self, request_id: str, prompt: PromptType,
                     params: SamplingParams) -> RequestOutputCollector:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use; pick a unique id.")
        times = RequestTimes(time.monotonic())
        prompt = self._tokenize(prompt)
        if isinstance(prompt, dict):
            times.num_prompt_tokens = len(prompt.get("prompt_token_ids", ()))
        collector = RequestOutputCollector(params.output_kind)
        self._requests[request_id] = _Request(collector, asyncio.get_running_loop(), times)
        try:
            engine_params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            self.engine.add_request(request_id, prompt, engine_params)
        except BaseException:
            del self._requests[request_id]
            raise
        self._wakeup.set()
        return collector

    def _tokenize(self, prompt: PromptType) -> PromptType:
        """Text (or vLLM's {"prompt": text}) → {"prompt", "prompt_token_ids"}, here, so the
        engine loop never waits for it. Anything else goes to the engine to validate."""
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            prompt = prompt.get("prompt", prompt)
        if isinstance(prompt, str) and self.tokenizer is not None:
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}
        return prompt

    def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                 request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as `sampling_params.output_kind` asks, until it finishes
        (`async for output in llm.generate(...)`). Invalid input raises ValueError at the call,
        before anything is queued; closing the generator early (a client that went away)
        aborts the request. Call it on the event loop that consumes it."""
        return self._stream(request_id, self._add_request(request_id, prompt, sampling_params))

    async def _stream(self, request_id: str,
                      collector: RequestOutputCollector) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # a consumer that stops after the last output aborts nothing
                self.abort_request(request_id)
            raise

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; each ends with finish_reason "abort" within one engine step."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.abort_request(rid)

    def abort_request(self, request_id: str) -> None:
        """abort() for code outside a coroutine; thread-safe."""
        if self.engine.abort_request(request_id):  # still in the inbox: never started
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._finished_early.append((request.times, time.monotonic()))
        self._wakeup.set()

    # ---- the engine loop ---------------------------------------------------------------------

    def _run_engine_loop(self) -> None:
        engine, last_log = self.engine, time.monotonic()
        try:
            while not self._stopping:
                self._wakeup.clear()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._dispatch(outputs, time.monotonic())
                else:
                    self._dispatch([], time.monotonic())
                    self._wakeup.wait(timeout=self.log_stats_interval)
                if time.monotonic() - last_log >= self.log_stats_interval:
                    last_log = time.monotonic()
                    for stat_logger in self.stat_loggers:
                        stat_logger.log()
        except BaseException as e:  # a bug, not a client's mistake: fail what is in flight
            logger.exception("the engine loop failed; in-flight requests fail with it")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine loop failed: {e!r}"))

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        """Time the outputs, hand them to their collectors, feed the stat loggers."""
        iteration = IterationStats()
        while self._finished_early:
            times, when = self._finished_early.popleft()
            iteration.finish(times, "abort", when)
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            iteration.observe(request.times, output, now)
            if output.finished:
                self._requests.pop(output.request_id, None)
            batches[request.loop].append((request.collector, output))
        self.metrics = self.engine.get_metrics()
        if outputs or iteration:  # before delivery: a client that got its output sees it counted
            for stat_logger in self.stat_loggers:
                stat_logger.record(self.metrics, iteration)
        for loop, items in batches.items():
            _call_soon(loop, _deliver, items)

    def _fail_all(self, error: BaseException) -> None:
        requests, self._requests = self._requests, {}
        for request in requests.values():
            _call_soon(request.loop, request.collector.put, error)

    # ---- vLLM's AsyncLLM surface -------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or not self.is_running

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """LLMEngine.get_metrics() as of the engine loop's latest step (safe from any thread)."""
        return self.metrics

    def shutdown(self) -> None:
        """Stop the engine loop, fail what is in flight, free the engine's memory."""
        if self._stopping:
            return
        self._stopping = True
        self._wakeup.set()
        self._thread.join()
        self._fail_all(EngineDeadError("the engine was shut down"))
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self.engine.shutdown()


def _deliver(items: list[tuple[RequestOutputCollector, RequestOutput]]) -> None:
    for collector, output in items:
        collector.put(output)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the consumer's event loop is closed: nobody is listening
        pass


_LIVE: weakref.WeakSet[AsyncLLM] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    """Stop engine loops before pagedjax.distributed frees engines at exit (atexit is LIFO)."""
    for llm in list(_LIVE):
        llm.shutdown()
