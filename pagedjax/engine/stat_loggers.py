"""AsyncLLM's stat loggers, as vLLM's: a periodic log line, and Prometheus metrics.

Both get `record(engine_metrics, iteration)` from the engine loop after every step:
`engine_metrics` is `LLMEngine.get_metrics()` (a fresh dict, never changed afterwards, so other
threads may read it), `iteration` the step's request timings (stats.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedjax.engine.stats import IterationStats

logger = logging.getLogger("pagedjax")

FINISH_REASONS = ("stop", "length", "abort")


class StatLogger(Protocol):
    def record(self, engine_metrics: dict[str, Any], iteration: IterationStats) -> None: ...

    def log(self) -> None: ...


def kv_cache_usage(metrics: dict[str, Any]) -> float:
    """Share of the KV pool held by requests (cached-but-free blocks count as free)."""
    total = metrics["kv_blocks_total"]
    return 1.0 - metrics["kv_blocks_free"] / total if total else 0.0


class LoggingStatLogger:
    """One line per `log()` call: throughput since the previous one, running/waiting requests,
    KV cache usage and the prefix cache hit rate (skipped while idle)."""

    def __init__(self) -> None:
        self.metrics: dict[str, Any] | None = None
        self._last: dict[str, Any] = {}
        self._last_time = time.monotonic()

    def record(self, engine_metrics: dict[str, Any], iteration: IterationStats) -> None:
        self.metrics = engine_metrics

    def log(self) -> None:
        now, m = time.monotonic(), self.metrics
        if m is None:
            return
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        delta = {k: m[k] - last.get(k, 0) for k in ("prompt_tokens_total",
                                                    "generation_tokens_total",
                                                    "prefix_cache_queries", "prefix_cache_hits")}
        self._last, self._last_time = m, now
        busy = m["num_requests_running"] or m["num_requests_waiting"]
        if not busy and not delta["prompt_tokens_total"] and not delta["generation_tokens_total"]:
            return
        hit_rate = delta["prefix_cache_hits"] / max(delta["prefix_cache_queries"], 1)
        line = (f"Avg prompt throughput: {delta['prompt_tokens_total'] / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {delta['generation_tokens_total'] / elapsed:.1f} "
                f"tokens/s, Running: {m['num_requests_running']} reqs, Waiting: "
                f"{m['num_requests_waiting']} reqs, KV cache usage: "
                f"{100 * kv_cache_usage(m):.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")
        if m.get("spec_decode_num_draft_tokens"):
            accepted = m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"]
            line += f", Draft acceptance rate: {100 * accepted:.1f}%"
        logger.info(line)


# vLLM's buckets, with finer ones at the low end for CPU-sized models
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine metric → (Prometheus counter name without "_total", help)
_ENGINE_COUNTERS = {
    "prompt_tokens_total": ("prompt_tokens", "Prefill tokens processed."),
    "generation_tokens_total": ("generation_tokens", "Generation tokens processed."),
    "num_preemptions_total": ("num_preemptions", "Cumulative number of preemptions."),
    "prefix_cache_queries": ("prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_verifications": ("spec_decode_num_drafts",
                                      "Verifications that carried at least one draft."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                        "Draft tokens accepted."),
    "num_compiles_after_startup": ("compiles_after_startup",
                                   "Step shapes compiled (JAX) or captured (CUDA graphs) after "
                                   "startup: outside the closed set, each one a stall."),
    "structured_output_requests_total": ("structured_output_requests",
                                         "Requests with a structured output constraint (json, "
                                         "regex, choice or grammar)."),
    "grammar_compiles_total": ("grammar_compiles",
                               "Grammars compiled for structured output requests."),
    "grammar_compile_seconds_total": ("grammar_compile_seconds",
                                      "Seconds spent compiling grammars."),
}


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class PrometheusStatLogger:
    """Prometheus metrics under vLLM's names with a `pagedjax:` prefix, in their own registry
    (several servers may share a process): gauges and counters read from the engine's latest
    metrics at scrape time, histograms of request timings, request_success by finish reason."""

    def __init__(self, model_name: str, max_model_len: int, prefix: str = "pagedjax:") -> None:
        self.registry = CollectorRegistry()
        self.model_name, self.prefix = model_name, prefix
        self.metrics: dict[str, Any] | None = None
        labels, reg = ["model_name"], self.registry

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(prefix + name, doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's outputs.",
                             _ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Mean time per output token of a finished request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish of a request.",
                             _E2E_BUCKETS)
        tokens = _token_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens",
                                       "Prompt tokens of a finished request.", tokens)
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Generated tokens of a finished request.", tokens)
        success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                          [*labels, "finished_reason"], registry=reg)
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        reg.register(self)  # collect() below: the engine's gauges and counters

    def record(self, engine_metrics: dict[str, Any], iteration: IterationStats) -> None:
        self.metrics = engine_metrics
        for seconds in iteration.time_to_first_tokens:
            self.ttft.observe(seconds)
        for seconds in iteration.inter_token_latencies:
            self.itl.observe(seconds)
        for finished in iteration.finished_requests:
            self.request_success[finished.finish_reason].inc()
            self.e2e.observe(finished.e2e_latency)
            self.prompt_tokens.observe(finished.num_prompt_tokens)
            self.generation_tokens.observe(finished.num_generation_tokens)
            if finished.mean_time_per_output_token is not None:
                self.tpot.observe(finished.mean_time_per_output_token)

    def log(self) -> None:
        pass

    def collect(self):
        """The engine's latest gauges and counters (called by prometheus_client on a scrape)."""
        m = self.metrics
        if m is None:
            return
        gauges = {"num_requests_running": ("Requests in the running batch.",
                                           m["num_requests_running"]),
                  "num_requests_waiting": ("Requests waiting to run.", m["num_requests_waiting"]),
                  "kv_cache_usage_perc": ("KV cache usage; 1 means 100 percent.",
                                          kv_cache_usage(m))}
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if key in m:
                counter = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
                counter.add_metric([self.model_name], m[key])
                yield counter
