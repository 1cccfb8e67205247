"""The speculation policy's cost table (spec_decode.AdaptiveSpeculation): one decode step's
seconds at each batch bucket and k, measured once per runner (device, code, shapes) at startup
and kept in pagedjax's cache folder beside the compiled steps."""

from __future__ import annotations

import hashlib
import json
import logging
import os

from pagedjax.cache import cache_dir, compile_cache_enabled
from pagedjax.config import EngineConfig
from pagedjax.core.model_runner import ModelRunner
from pagedjax.core.spec_decode import StepCosts, measure_step_costs, warm_up_decode_steps
from pagedjax.core.step_shapes import StepShapes

logger = logging.getLogger(__name__)


def step_costs(runner: ModelRunner, shapes: StepShapes, config: EngineConfig) -> StepCosts:
    """The table for this runner: from the cache folder, or measured (and stored there)."""
    key = hashlib.sha256(f"{runner.cache_key()}|{shapes!r}".encode()).hexdigest()
    path = cache_dir() / "step_costs" / f"{key[:32]}.json"
    if compile_cache_enabled() and path.is_file():
        table = json.loads(path.read_text())
        # measuring runs every step the table times; loaded, none has run in this process yet
        warm_up_decode_steps(runner.execute, shapes, config, runner.num_kv_blocks)
        return {int(s): {int(k): t for k, t in row.items()} for s, row in table.items()}
    costs = measure_step_costs(runner.execute, shapes, config, runner.num_kv_blocks)
    if compile_cache_enabled():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(costs))
        tmp.replace(path)
    logger.info("step costs (ms) by batch bucket and k: %s", {
        s: {k: round(1e3 * t, 2) for k, t in row.items()} for s, row in costs.items()})
    return costs
