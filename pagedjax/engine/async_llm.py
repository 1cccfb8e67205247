"""AsyncLLM: the engine for asyncio code (the OpenAI server), under vLLM's names.

The engine core runs in a process of its own by default (core_client.MPClient), or on a thread
of this one (InprocClient: multiprocess=False, or PAGEDJAX_ENGINE_CORE_PROCESS=0). Either way
requests are validated and tokenized here, at the call; each request has a
RequestOutputCollector on its caller's event loop, and the client's thread hands it every
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

from pagedjax import envs
from pagedjax.config import EngineConfig
from pagedjax.engine.core_client import EngineDeadError, InprocClient, MPClient
from pagedjax.engine.llm_engine import LLMEngine, PromptType
from pagedjax.engine.output_collector import RequestOutputCollector
from pagedjax.engine.stat_loggers import LoggingStatLogger, StatLogger
from pagedjax.engine.stats import IterationStats, RequestTimes
from pagedjax.engine_args import EngineArgs
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncEngineArgs", "AsyncLLM", "EngineDeadError"]

logger = logging.getLogger("pagedjax")

StatLoggerFactory = Callable[[EngineConfig], StatLogger]
EngineClient = InprocClient | MPClient


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (vLLM's name): the same options."""


@dataclass
class _Request:
    collector: RequestOutputCollector
    loop: asyncio.AbstractEventLoop
    times: RequestTimes


def default_multiprocess() -> bool:
    """The engine core in its own process unless PAGEDJAX_ENGINE_CORE_PROCESS=0."""
    return envs.PAGEDJAX_ENGINE_CORE_PROCESS is not False


class AsyncLLM:
    """Serve requests from asyncio code over an engine core.

    >>> llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model="path/to/checkpoint"))
    >>> async for output in llm.generate("def f(x):", SamplingParams(max_tokens=8), "r1"):
    ...     print(output.outputs[0].text)
    """

    def __init__(self, client: EngineClient, *, log_stats: bool = True,
                 stat_loggers: list[StatLoggerFactory] | None = None,
                 log_stats_interval: float = 10.0) -> None:
        """stat_loggers: factories (engine config → StatLogger), as vLLM's; log_stats adds the
        periodic log line, every log_stats_interval seconds."""
        self.client = client
        self.config, self.model_config = client.config, client.model_config
        self.tokenizer = client.tokenizer
        self.stat_loggers = [factory(client.config) for factory in stat_loggers or []]
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self.log_stats_interval = log_stats_interval
        self._last_log = time.monotonic()
        self._requests: dict[str, _Request] = {}
        self._finished_early: deque[tuple[RequestTimes, float]] = deque()  # aborted, queued
        self._lock = threading.Lock()  # _requests, between the event loops and the client
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.metrics = client.get_metrics()  # replaced (never changed) with each step's
        for stat_logger in self.stat_loggers:
            stat_logger.record(self.metrics, IterationStats())
        client.start(self._dispatch, self._fail)
        _LIVE.add(self)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, multiprocess: bool | None = None,
                         **kwargs: Any) -> AsyncLLM:
        """Load the model (logging the load time, the KV cache size and the concurrency it
        allows) and start the engine core: in its own process unless multiprocess=False.
        kwargs: AsyncLLM's (log_stats, stat_loggers, ...)."""
        start = time.perf_counter()
        config = engine_args.create_engine_config()
        if default_multiprocess() if multiprocess is None else multiprocess:
            client = MPClient(config)
        else:
            client = InprocClient(LLMEngine(config))
        config, metrics = client.config, client.get_metrics()
        num_tokens = metrics["kv_blocks_total"] * config.block_size
        logger.info("Loaded %s (backend %s, %s) in %.1f s%s", config.model, config.backend,
                    config.dtype, time.perf_counter() - start,
                    ", engine core in its own process" if isinstance(client, MPClient) else "")
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; maximum concurrency for "
                    "%d tokens per request: %.2fx", metrics["kv_blocks_total"],
                    config.block_size, num_tokens, config.max_model_len,
                    num_tokens / config.max_model_len)
        return cls(client, **kwargs)

    # ---- requests ----------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams) -> RequestOutputCollector:
        """Queue a request; its outputs arrive in the returned collector. Invalid input raises
        ValueError (or TypeError) here, and nothing is queued."""
        return self._add_request(request_id, prompt, sampling_params)

    def _add_request(self, request_id: str, prompt: PromptType,
                     params: SamplingParams) -> RequestOutputCollector:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core has stopped: {self.dead_error}")
        times = RequestTimes(time.monotonic())
        collector = RequestOutputCollector(params.output_kind)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id={request_id!r} is already in use; pick a unique "
                                 "id.")
            self._requests[request_id] = _Request(collector, asyncio.get_running_loop(), times)
        try:
            engine_params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            self.client.add_request(request_id, prompt, engine_params)
        except BaseException:
            with self._lock:
                del self._requests[request_id]
            raise
        return collector

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
        if self.dead_error is None and self.client.abort_request(request_id):
            with self._lock:  # still queued: never started, no output will come
                request = self._requests.pop(request_id, None)
            if request is not None:
                self._finished_early.append((request.times, time.monotonic()))

    # ---- the client's thread -----------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput], metrics: dict[str, Any] | None) -> None:
        """Time the outputs, hand them to their collectors, feed the stat loggers (and log
        every log_stats_interval)."""
        now = time.monotonic()
        iteration = IterationStats()
        while self._finished_early:
            times, when = self._finished_early.popleft()
            iteration.finish(times, "abort", when)
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for output in outputs:
                request = self._requests.get(output.request_id)
                if request is None:
                    continue
                iteration.observe(request.times, output, now)
                if output.finished:
                    del self._requests[output.request_id]
                batches[request.loop].append((request.collector, output))
        if metrics is not None:
            self.metrics = metrics
        if outputs or iteration:  # before delivery: a client that got its output sees it counted
            for stat_logger in self.stat_loggers:
                stat_logger.record(self.metrics, iteration)
        for loop, items in batches.items():
            _call_soon(loop, _deliver, items)
        if now - self._last_log >= self.log_stats_interval:
            self._last_log = now
            for stat_logger in self.stat_loggers:
                stat_logger.log()

    def _fail(self, error: BaseException) -> None:
        """The engine core is gone: every request in flight fails with its error."""
        self.dead_error = error
        with self._lock:
            requests, self._requests = self._requests, {}
        for request in requests.values():
            _call_soon(request.loop, request.collector.put, error)

    # ---- vLLM's AsyncLLM surface -------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.client.is_alive

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or not self.is_running

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine core has stopped: {self.dead_error}")

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """The engine core's get_metrics() as of its latest step (safe from any thread)."""
        return self.metrics

    def shutdown(self) -> None:
        """Stop the engine core, fail what is in flight, free its memory."""
        if self._stopping:
            return
        self._stopping = True
        self.client.shutdown()
        self._fail(self.dead_error or EngineDeadError("the engine was shut down"))


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
    """Stop engine cores before pagedjax.distributed frees engines at exit (atexit is LIFO)."""
    for llm in list(_LIVE):
        llm.shutdown()
