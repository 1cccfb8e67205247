"""How many KV blocks an engine takes on an accelerator: gpu_memory_utilization of the device
less this engine's own use (vLLM's per-instance rule), never more than is free."""

from __future__ import annotations

import pytest

from pagedjax.config import EngineConfig
from pagedjax.core.kv_cache import num_kv_blocks_for_budget

GIB = 1 << 30


def config(utilization: float) -> EngineConfig:
    return EngineConfig(model="unused", max_model_len=1024, max_num_seqs=8,
                        gpu_memory_utilization=utilization)


def test_two_engines_at_04_share_a_device() -> None:
    per_block = 1 << 20
    first = num_kv_blocks_for_budget(per_block, config(0.4),
                                     {"bytes_limit": 100 * GIB, "bytes_in_use": 5 * GIB})
    assert first == 35 * 1024  # 40 GiB less its own 5
    # the second engine starts with the first's 40 GiB taken: its budget is its own
    second = num_kv_blocks_for_budget(per_block, config(0.4), {
        "bytes_limit": 100 * GIB, "bytes_in_use": 5 * GIB, "bytes_free": 55 * GIB})
    assert second == first


def test_the_pool_never_takes_more_than_is_free() -> None:
    stats = {"bytes_limit": 100 * GIB, "bytes_in_use": 5 * GIB, "bytes_free": 10 * GIB}
    assert num_kv_blocks_for_budget(1 << 20, config(0.9), stats) == 10 * 1024
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_kv_blocks_for_budget(1 << 20, config(0.9), {**stats, "bytes_free": 1 << 20})
