"""`pagedjax serve` as a real subprocess on 127.0.0.1, for the tests that talk to it over HTTP."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(model: str, args: list[str], log_path: Path
                  ) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of `pagedjax serve MODEL --port P ARGS...`, healthy; stopped with
    SIGINT (then killed) on exit. Its output goes to log_path, shown if it dies while starting."""
    port = free_port()
    command = [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", model, "--port",
               str(port), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(url + "/health") as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
