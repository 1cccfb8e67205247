"""One-off work some tests need, started when the session is collected, in the background at the
lowest CPU priority: it runs in the share of this 2-core machine that the tests before them
leave idle (XLA compiles and Python are mostly one thread), and the tests wait for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

# SmolLM2's GGUF file converted to a checkpoint in the session's cache folder (~45 s, one thread),
# once: the workers of `pytest -n 2` share that folder, and the second waits for the first.
SMOLLM2_CONVERSION = pytest.StashKey[subprocess.Popen]()
_CONVERT_SMOLLM2 = ("import fcntl; from pagedjax.cache import cache_dir; "
                    "from pagedjax.model_loader.demo import smollm2_instruct_dir; "
                    "cache_dir().mkdir(parents=True, exist_ok=True); "
                    "lock = open(cache_dir() / 'smollm2.lock', 'w'); "
                    "fcntl.flock(lock, fcntl.LOCK_EX); smollm2_instruct_dir()")


def start_low_priority(argv: list[str], **kwargs) -> subprocess.Popen:
    """argv at nice 19, in a process group of its own (stop() ends its children too).

    A process group, not a session: with the kernel's autogroup scheduling (on by default on
    desktop and many server kernels) every session is a group that gets an equal share of the
    CPUs whatever its processes' nice values, so four background sessions took 4/5 of this
    2-core machine from the tests (architectures' tests ran 3x slower beside them)."""
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19),
                            process_group=0, **kwargs)


def start_smollm2_conversion() -> subprocess.Popen:
    return start_low_priority([sys.executable, "-c", _CONVERT_SMOLLM2],
                              stderr=subprocess.DEVNULL)


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
