"""Compiled steps kept on disk, so that a second process loads its closed set of step shapes in
seconds instead of tracing and compiling every one.

JAX's own compilation cache is keyed by the traced program, so a hit still pays for tracing each
step (0.4-1 s for the demo model on a 2-core CPU: 6 s for the 13 plain shapes, 40 s with a
draft). This store is keyed by what the trace depends on instead: pagedjax's source, the jax
versions, the platform and its CPU features, XLA_FLAGS, and the runner's own description (model
configs, dtypes, parameter and KV-cache shapes, the shapes of the step). A key that matches
deserializes the executable (`jax.experimental.serialize_executable`); anything else compiles,
and stores.

Where the user has turned JAX's persistent cache on, the store stays off and that cache serves:
an executable compiled while it is on can serialize without some of its functions (seen on CPU
with jax 0.10: "Function ... not found" when loaded in another process).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import platform
from collections.abc import Hashable
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from pagedjax.cache import cache_dir, compile_cache_enabled, source_digest

logger = logging.getLogger(__name__)


def _machine() -> str:
    """The platform, its devices and (on CPU, where XLA compiles for the host) its features."""
    devices = jax.devices()
    parts = [jax.__version__, jax.lib.__version__, jax.default_backend(),
             ",".join(sorted({d.device_kind for d in devices})), str(len(devices)),
             os.environ.get("XLA_FLAGS", ""), platform.machine()]
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        parts += [line for line in cpuinfo if line.startswith(("flags", "model name"))][:2]
    except OSError:
        pass
    return "|".join(parts)


class ExecutableStore:
    """Executables of one runner, by key (a step's BatchLayout, or a name)."""

    def __init__(self, description: str, devices: list[jax.Device]) -> None:
        """description: everything besides the key that the runner's traces depend on;
        devices: the ones its executables run on (a loaded executable would otherwise take
        every device of the platform)."""
        self.devices = devices
        self.enabled = compile_cache_enabled() and jax.config.jax_compilation_cache_dir is None
        self.root = cache_dir() / "steps"
        ids = [d.id for d in devices]
        digest = hashlib.sha256(f"{source_digest()}|{_machine()}|{ids}|{description}".encode())
        self.key = digest.hexdigest()[:24]  # what every entry of this runner shares
        self.hits = 0

    def _path(self, key: Hashable) -> Path:
        name = hashlib.sha256(f"{self.key}|{key!r}".encode()).hexdigest()[:32]
        return self.root / f"{name}.exe"

    def load(self, key: Hashable) -> jax.stages.Compiled | None:
        """The stored executable of key, or None (not stored, or not loadable any more)."""
        path = self._path(key)
        if not self.enabled or not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            executable = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=self.devices)
        except Exception as error:  # a stale or truncated entry: compile it again
            logger.warning("could not load the compiled step %s (%s); compiling it again",
                           path, error)
            return None
        self.hits += 1
        return executable

    def save(self, key: Hashable, executable: jax.stages.Compiled) -> None:
        if not self.enabled:
            return
        path = self._path(key)
        try:
            blob = pickle.dumps(serialize_executable.serialize(executable))
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            tmp.replace(path)  # atomic: concurrent processes never read half a file
        except Exception as error:  # a full disk or an unserializable executable: no cache
            logger.warning("could not store the compiled step %s (%s)", path, error)


def load_copy(executable: jax.stages.Compiled, devices: list[jax.Device]) -> jax.stages.Compiled:
    """A second, independent copy of a compiled step (serialized and loaded again): on a GPU it
    records its own CUDA graph, so two copies called in turn each see the same buffer
    addresses every other call where one copy would see them change every call."""
    payload, in_tree, out_tree = serialize_executable.serialize(executable)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                     execution_devices=devices)
