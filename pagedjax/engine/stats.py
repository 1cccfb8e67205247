"""Request timing as vLLM defines it: TTFT, inter-token latency, time per output token, E2E;
and where each engine step's time goes (StepTimings).

AsyncLLM's output handler feeds each step's DELTA outputs to `IterationStats.observe` and hands
the stats to its stat loggers (stat_loggers.py). Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.outputs import RequestOutput

# A step's phases: launch, the runner's call that starts the step (the whole step where it runs
# as called); execute, waiting for its outputs; output, the engine core's outputs and the
# frontend's (RequestOutputs, stop strings, logprobs) but text; detokenize, the text.
STEP_PHASES = ("schedule", "prepare", "launch", "execute", "update", "output", "detokenize")


@dataclass
class StepTimings:
    """Wall seconds spent in each phase of the engine's steps, summed over steps."""

    num_steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def record(self, stamps: list[float]) -> None:
        """One step of the engine core: stamps are its start, then the end of each phase
        up to its output."""
        self.num_steps += 1
        for name, start, end in zip(STEP_PHASES, stamps, stamps[1:]):
            self.seconds[name] += end - start

    def add(self, phase: str, seconds: float) -> None:
        """Work of the frontend's on a step's outputs."""
        self.seconds[phase] += seconds


@dataclass
class RequestTimes:
    """One request's progress as the frontend saw it."""

    arrival_time: float
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # arrival → finish
    num_prompt_tokens: int
    num_generation_tokens: int
    # (last token − first token) / (tokens − 1): vLLM's TPOT; None below two tokens
    mean_time_per_output_token: float | None


@dataclass
class IterationStats:
    """What one engine step (or an idle moment) produced, for the stat loggers."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def observe(self, times: RequestTimes, output: RequestOutput, now: float) -> None:
        """Account one DELTA output of a request at time `now`."""
        num_new = sum(len(c.token_ids) for c in output.outputs)
        if num_new:
            if times.first_token_time is None:
                times.first_token_time = now
                self.time_to_first_tokens.append(now - times.arrival_time)
            else:
                self.inter_token_latencies.append(now - times.last_token_time)
            times.last_token_time = now
            times.num_generation_tokens += num_new
        if output.finished:
            reasons = [c.finish_reason for c in output.outputs]
            aborted = "abort" in reasons or not reasons[0]
            self.finish(times, "abort" if aborted else reasons[0], now)

    def finish(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        tpot = None
        if times.num_generation_tokens > 1:
            tpot = ((times.last_token_time - times.first_token_time)
                    / (times.num_generation_tokens - 1))
        self.finished_requests.append(FinishedRequestStats(
            finish_reason, now - times.arrival_time, times.num_prompt_tokens,
            times.num_generation_tokens, tpot))

    def __bool__(self) -> bool:
        return bool(self.time_to_first_tokens or self.inter_token_latencies
                    or self.finished_requests)
