"""Helpers that tests of the engine and of the server share."""

from __future__ import annotations

import time

from pagedjax.engine.stats import FinishedRequestStats, IterationStats


class FinishedRecorder:
    """A stat logger that keeps every finished request's stats (to check aborts)."""

    def __init__(self) -> None:
        self.finished: list[FinishedRequestStats] = []

    def record(self, engine_metrics: dict, iteration: IterationStats) -> None:
        self.finished += iteration.finished_requests

    def log(self) -> None:
        pass


def wait_until(condition, timeout: float = 60.0) -> bool:
    """Poll condition() until it holds (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
