"""The harness of the repository's benchmarks: the package's (`pagedjax.benchmarks.harness`: the
environment record, `--out DIR` and the JSON, tables, the model, turns) and what only these
scripts use: timing a kernel on the device, capturing native stderr, and stepping an engine's
decode steps one by one.

A script here imports it as `common` (benchmarks/ is not a package): those in benchmarks/ put
their own folder on sys.path, those in benchmarks/probes/ its parent. Nothing here imports jax
or torch: a benchmark process uses one framework only.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedjax.benchmarks.harness import (
    RANDOM_LLAMA,
    RESULTS_DIR,
    accelerator_tag,
    add_async_scheduling_argument,
    add_dtype_argument,
    add_model_arguments,
    add_out_argument,
    args_record,
    environment,
    in_turn,
    model_dir,
    model_name,
    paired_ratio,
    print_table,
    step_phases_ms,
    write_json,
)

__all__ = [  # the package harness's, for the scripts here
    "RANDOM_LLAMA", "RESULTS_DIR", "accelerator_tag", "add_async_scheduling_argument",
    "add_dtype_argument", "add_model_arguments", "add_out_argument", "args_record",
    "environment", "in_turn", "model_dir", "model_name", "paired_ratio", "print_table",
    "step_phases_ms", "write_json",
    # and these scripts' own
    "WARMUP_STEPS", "add_output_kind_argument", "finish", "median_seconds", "output_kind",
    "start_decoding", "stderr_fd_captured", "time_engine_steps",
]

WARMUP_STEPS = 3  # decode steps left untimed after the prefill (the decode shape compiles)


def median_seconds(run: Callable[[], Any], synchronize: Callable[[Any], Any],
                   repeats: int) -> float:
    """Median wall time per call, synchronised on the device.

    Short kernels are timed in back-to-back groups (one sync per group) so that launch
    latency overlaps with the previous call, as it does in a model step.
    """
    synchronize(run())  # compile and warm up
    start = time.perf_counter()
    synchronize(run())
    single = time.perf_counter() - start
    group = max(1, min(50, int(2e-3 / max(single, 1e-7))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(group):
            out = run()
        synchronize(out)
        samples.append((time.perf_counter() - start) / group)
    return statistics.median(samples)


@contextlib.contextmanager
def stderr_fd_captured():
    """What native code writes to file descriptor 2 meanwhile, in log["text"] (xgrammar logs
    the schema keywords it ignores there; XLA its command-buffer updates)."""
    log = {"text": ""}
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            log["text"] = tmp.read().decode(errors="replace")


def add_output_kind_argument(parser) -> None:
    parser.add_argument("--output-kind", choices=("final", "delta"), default="final",
                        help="final: one output per request at its end (LLM.generate); delta: "
                             "an output every step (a streaming server)")


def output_kind(args):
    """The RequestOutputKind of --output-kind."""
    from pagedjax.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY if args.output_kind == "final" else RequestOutputKind.DELTA


def start_decoding(llm, batch: int, context: int, *, max_tokens: int, seed: int,
                   output_kind=None) -> list[str]:
    """Add `batch` requests of `context` random prompt tokens (greedy, EOS ignored; output_kind:
    a RequestOutputKind, default LLM.generate's: FINAL_ONLY) and step until every one of them
    decodes (prompts computed) and the decode shape has run WARMUP_STEPS times. The request
    ids."""
    from pagedjax import SamplingParams
    from pagedjax.sampling_params import RequestOutputKind

    engine, scheduler = llm.engine, llm.engine.scheduler
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=output_kind or RequestOutputKind.FINAL_ONLY)
    ids = [f"decode-{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = rng.integers(1, engine.model_config.vocab_size, context).tolist()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)

    def decoding() -> bool:  # every prompt computed: each step decodes one token per sequence
        return (len(scheduler.running) == batch and not scheduler.waiting
                and all(s.num_computed_tokens == s.num_tokens - 1 for s in scheduler.running))

    while engine.has_unfinished_requests() and not decoding():
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    if not decoding():
        raise RuntimeError(f"{len(scheduler.running)} of {batch} sequences decode: the KV pool "
                           "is too small for this batch and context, or max_tokens too few; "
                           "lower --context.")
    return ids


def time_engine_steps(llm, batch: int, num_steps: int) -> list[float]:
    """Seconds of each of num_steps engine steps, the engine's step_timings counting them alone;
    fails unless every one decoded the whole batch (none preempted or finished)."""
    engine = llm.engine
    preemptions = engine.scheduler.num_preemptions_total
    engine.step_timings.__init__()
    seconds = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    if engine.scheduler.num_preemptions_total != preemptions or len(
            engine.scheduler.running) != batch:
        raise RuntimeError("a sequence was preempted or finished while timed: not a decode "
                           "step of the whole batch; lower --context or --steps.")
    return seconds


def finish(llm, request_ids: list[str]) -> None:
    """Abort the requests and step the engine until it holds none."""
    for request_id in request_ids:
        llm.engine.abort_request(request_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
