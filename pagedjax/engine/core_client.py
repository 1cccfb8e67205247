"""How AsyncLLM reaches the engine core: in a process of its own (MPClient, the default, as
vLLM V1's EngineCoreProc and AsyncMPClient), or on a thread of this one (InprocClient); and the
offline LLM, with multiprocess=True (SyncMPClient).

MPClient starts the core as a plain subprocess of this Python (no fork of a process that holds
a framework, no re-import of the caller's main module) and talks to it over
two ZeroMQ sockets in msgpack (msgspec): requests, aborts and stop-string finishes one way,
each step's EngineCoreOutputs the other. The frontend keeps the input processor (validation,
tokenization) and the output processor (detokenization, stop strings, RequestOutputs) on its
side, so HTTP handling and text never take the engine loop's GIL.

A core that exits or fails fails every request in flight (EngineDeadError) and the frontend
reports unhealthy; a frontend that goes away makes its core exit.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pagedjax import envs
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.engine.core_messages import EngineCoreOutputs, EngineCoreRequest, FinishSequence
from pagedjax.engine.input_processor import EngineLimits, InputProcessor, PromptType
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.model_loader.tokenizer import load_tokenizer
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# outputs (list[RequestOutput]) and the core's metrics when they came with them
OnOutputs = Callable[[list[RequestOutput], dict[str, Any] | None], None]
OnDead = Callable[[BaseException], None]

# message kinds, the first frame of each message
ADD, ABORT, FINISH, SHUTDOWN = b"add", b"abort", b"finish", b"shutdown"  # frontend → core
READY, OUTPUTS, FAILED = b"ready", b"outputs", b"failed"  # core → frontend
POLL_MS = 100  # how often either side looks at the other when there is nothing to read
METRICS_INTERVAL_S = 0.5  # the core's metrics go out with its outputs at least this often


class EngineDeadError(RuntimeError):
    """The engine core stopped (shut down, its process exited, or a step failed); no request
    can finish."""


class Ready(msgspec.Struct):
    """What the core sends once its model is loaded and its steps compiled."""

    config: dict[str, Any]  # its EngineConfig, resolved (max_model_len, dtype)
    limits: EngineLimits
    metrics: dict[str, Any]


# ---- the core's side ----------------------------------------------------------------------------


class EngineCoreProc:
    """The engine core's loop in its process: read what came, step while there is work, send
    each step's outputs."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.connect(output_address)
        self.parent_pid = os.getppid()
        self.decoders = {ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
                         ABORT: msgspec.msgpack.Decoder(list[str]),
                         FINISH: msgspec.msgpack.Decoder(list[FinishSequence])}
        self.encoder = msgspec.msgpack.Encoder()
        self.fail_after_steps = envs.PAGEDJAX_TEST_FAIL_STEP_AFTER  # a test's injected failure
        try:
            from pagedjax.engine.core import EngineCore
            from pagedjax.engine.llm_engine import engine_limits

            self.core = EngineCore(config)
        except BaseException as error:
            self._send(FAILED, f"the engine core failed to start: {error!r}")
            raise
        self._send(READY, Ready(msgspec.to_builtins(config), engine_limits(self.core),
                                self.core.get_metrics()))

    def _send(self, kind: bytes, payload: Any) -> None:
        self.output.send_multipart([kind, self.encoder.encode(payload)])

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        last_metrics, num_steps = time.monotonic(), 0
        try:
            while True:
                busy, arrived = self.core.has_unfinished_requests(), False
                if poller.poll(0 if busy else POLL_MS):
                    arrived = True
                    if not self._read():
                        return
                elif not busy and os.getppid() != self.parent_pid:
                    return  # the frontend is gone
                if not self.core.has_unfinished_requests():
                    continue
                num_steps += 1
                if num_steps > self.fail_after_steps > 0:
                    raise RuntimeError(f"PAGEDJAX_TEST_FAIL_STEP_AFTER={self.fail_after_steps}: "
                                       "this step fails on purpose")
                outputs = self.core.step()
                now = time.monotonic()
                # the metrics go out when requests come, finish, or now and then
                if (arrived or now - last_metrics >= METRICS_INTERVAL_S or any(
                        o.finish_reason for o in outputs.outputs) or outputs.request_outputs
                        or not self.core.has_unfinished_requests()):
                    outputs.metrics, last_metrics = self.core.get_metrics(), now
                if not outputs.empty or outputs.metrics is not None:
                    self._send(OUTPUTS, outputs)
        except BaseException as error:
            logger.exception("the engine core failed")
            self._send(FAILED, f"the engine core failed: {error!r}\n"
                               f"{traceback.format_exc(limit=3)}")
            raise
        finally:
            self.core.shutdown()

    def _read(self) -> bool:
        """Apply every message waiting; False on shutdown."""
        while True:
            try:
                kind, payload = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if kind == SHUTDOWN:
                return False
            message = self.decoders[kind].decode(payload)
            if kind == ADD:
                self.core.add_request(message)
            elif kind == ABORT:
                self.core.abort_requests(message)
            else:
                self.core.finish_sequences(message)


def main() -> None:
    """The core process: argv INPUT OUTPUT (its sockets' addresses), the EngineConfig on
    stdin."""
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s [core %(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    EngineCoreProc(config, sys.argv[-2], sys.argv[-1]).run()


# ---- the frontend's side ------------------------------------------------------------------------


class MPClient:
    """The frontend of an engine core in its own process (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="pagedjax-core-")
        addresses = [f"ipc://{Path(self._folder.name) / name}" for name in ("in", "out")]
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)  # to the core
        self._input.bind(addresses[0])
        self._output = self._context.socket(zmq.PULL)  # from the core
        self._output.bind(addresses[1])
        self._encoder = msgspec.msgpack.Encoder()
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from pagedjax.engine.core_client import main; main()",
             *addresses], stdin=subprocess.PIPE)
        self.process.stdin.write(self._encoder.encode(config))
        self.process.stdin.close()
        ready = self._wait_ready()
        self.config = EngineConfig(**{k: v for k, v in ready.config.items()
                                      if k in EngineConfig.__dataclass_fields__})
        self.model_config = ModelConfig.from_pretrained(self.config.model)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self.metrics = ready.metrics
        self.input_processor = InputProcessor(self.tokenizer, ready.limits, self.config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()  # the output processor and the input socket
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _wait_ready(self) -> Ready:
        """Wait for the core to load (minutes, if it compiles); its error if it fails."""
        while not self._output.poll(POLL_MS):
            if self.process.poll() is not None:
                self._close()
                raise EngineDeadError(f"the engine core process exited with code "
                                      f"{self.process.returncode} while starting")
        kind, payload = self._output.recv_multipart()
        if kind == FAILED:
            self.process.wait()
            self._close()
            raise EngineDeadError(msgspec.msgpack.decode(payload))
        return msgspec.msgpack.decode(payload, type=Ready)

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        """Hand each step's RequestOutputs to on_outputs (on a thread of this client's), and
        the error to on_dead once the core is gone."""
        self._thread = threading.Thread(target=self._run_output_loop, args=(on_outputs, on_dead),
                                        daemon=True, name="pagedjax-core-outputs")
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams) -> None:
        """Validate (ValueError here, nothing sent) and send a request."""
        text, request = self.input_processor.process_inputs(request_id, prompt, params)
        with self._lock:
            if request_id in self.output_processor.requests:
                raise ValueError(f"request_id={request_id!r} is already in use; pick a unique "
                                 "id.")
            self.output_processor.add_request(request, text)
            self._send(ADD, request)

    def abort_request(self, request_id: str) -> bool:
        """The core ends it at its next step (its final output "abort"); False: it started."""
        with self._lock:
            if request_id in self.output_processor.requests:
                try:
                    self._send(ABORT, [request_id])
                except EngineDeadError:
                    pass  # the core is gone: its requests fail with it (on_dead)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_metrics(self) -> dict[str, Any]:
        return self.metrics

    def _send(self, kind: bytes, payload: Any) -> None:
        """Send to the core; EngineDeadError if it has exited. A PUSH socket with no peer
        blocks a send for ever (a core killed before this request): it waits for room only
        while the core lives."""
        frames = [kind, self._encoder.encode(payload)]
        while not self._input.poll(POLL_MS, zmq.POLLOUT):
            if self.process.poll() is not None:
                raise EngineDeadError(f"the engine core process exited with code "
                                      f"{self.process.returncode}")
        self._input.send_multipart(frames)

    def _run_output_loop(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        try:
            while not self._stopping:
                if not self._output.poll(POLL_MS):
                    if self.process.poll() is not None:
                        raise EngineDeadError(f"the engine core process exited with code "
                                              f"{self.process.returncode}")
                    on_outputs([], None)  # a tick: the stat loggers' periodic log
                    continue
                kind, payload = self._output.recv_multipart()
                if kind == FAILED:
                    raise EngineDeadError(msgspec.msgpack.decode(payload))
                outputs = decoder.decode(payload)
                with self._lock:
                    results, finishes = self.output_processor.process(outputs)
                    if finishes:
                        self._send(FINISH, finishes)
                if outputs.metrics is not None:
                    self.metrics = outputs.metrics
                on_outputs(results, outputs.metrics)
        except BaseException as error:  # noqa: BLE001 (every request in flight fails with it)
            if not self._stopping:
                logger.error("the engine core is gone: %s", error)
                on_dead(error if isinstance(error, EngineDeadError)
                        else EngineDeadError(f"the engine core failed: {error!r}"))

    def shutdown(self) -> None:
        """Stop the core (killed if it does not stop in time) and this client's thread."""
        if self._stopping:
            return
        self._stopping = True
        if self.process.poll() is None:
            with self._lock:
                self._send(SHUTDOWN, None)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._thread is not None:
            self._thread.join()
        self._close()

    def _close(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        self._folder.cleanup()


class SyncMPClient(MPClient):
    """The offline LLM's engine core in its own process (vLLM V1's SyncMPClient): this client's
    thread turns each step's token ids into RequestOutputs (text, stop strings) while the core
    runs its next steps; step() hands over what is ready, as LLMEngine.step() does."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # lists of RequestOutputs, or the error the core died of
        self._ready: queue.SimpleQueue[list[RequestOutput] | BaseException] = queue.SimpleQueue()
        self.start(self._on_outputs, self._ready.put)

    def _on_outputs(self, outputs: list[RequestOutput], metrics: dict[str, Any] | None) -> None:
        if outputs:
            self._ready.put(outputs)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or not self._ready.empty()

    @property
    def num_generation_tokens(self) -> int:
        """Tokens generated so far, as of the core's last metrics (a progress bar's rate)."""
        return self.metrics.get("generation_tokens_total", 0)

    def step(self) -> list[RequestOutput]:
        """Every output built since the last call; waits for one while requests are
        unfinished. Raises EngineDeadError if the core is gone."""
        results: list[RequestOutput] = []
        while self.has_unfinished_requests():
            try:
                item = (self._ready.get_nowait() if results
                        else self._ready.get(timeout=POLL_MS / 1000))
            except queue.Empty:
                if results:
                    break
                continue
            if isinstance(item, BaseException):
                raise item
            results += item
        return results


class InprocClient:
    """The engine core on a thread of this process (an LLMEngine stepped by an engine loop):
    what AsyncLLM uses with multiprocess=False (tests that reach into the engine, a machine
    where a second process does not pay)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # an LLMEngine
        self.config, self.model_config = engine.config, engine.model_config
        self.tokenizer = engine.tokenizer
        self.metrics = engine.get_metrics()  # replaced (never changed) by the engine loop
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self._thread = threading.Thread(target=self._run_engine_loop,
                                        args=(on_outputs, on_dead), daemon=True,
                                        name="pagedjax-engine-loop")
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams) -> None:
        self.engine.add_request(request_id, prompt, params)
        self._wakeup.set()

    def abort_request(self, request_id: str) -> bool:
        """True: it was still queued, and is dropped with no output."""
        dropped = self.engine.abort_request(request_id)
        self._wakeup.set()
        return dropped

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_metrics(self) -> dict[str, Any]:
        return self.metrics

    def _run_engine_loop(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self.metrics = engine.get_metrics()
                    on_outputs(outputs, self.metrics)
                else:
                    on_outputs([], None)  # a tick: the stat loggers' periodic log
                    self._wakeup.wait(timeout=POLL_MS / 1000)
        except BaseException as error:  # noqa: BLE001 (a bug, not a client's mistake)
            logger.exception("the engine loop failed; in-flight requests fail with it")
            on_dead(EngineDeadError(f"the engine loop failed: {error!r}"))

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
        self.engine.shutdown()

