"""The speculation policy's step-cost table: measured once, then loaded from the cache folder,
where each step it times still runs once at startup."""

from __future__ import annotations

import collections
from types import SimpleNamespace

from pagedjax.core.step_shapes import StepShapes
from pagedjax.engine.step_costs import step_costs


class CountingRunner:
    """Runs nothing: counts each decode step's executions by (sequences, k)."""

    num_kv_blocks = 64

    def __init__(self, key: str) -> None:
        self.key = key
        self.runs: collections.Counter = collections.Counter()

    def cache_key(self) -> str:
        return self.key

    def execute(self, model_input) -> None:
        layout = model_input.layout
        self.runs[layout.num_seqs, layout.num_spec_tokens] += 1


def test_a_loaded_table_runs_each_timed_step_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    shapes = StepShapes.for_engine(max_num_seqs=4, max_num_batched_tokens=64,
                                   max_blocks_per_seq=8, max_model_len=128,
                                   num_speculative_tokens=4)
    config = SimpleNamespace(block_size=16, max_model_len=128)
    cells = {(s, k) for s in shapes.seq_buckets for k in (0, *shapes.spec_ks)}
    measuring = CountingRunner("test-runner")
    table = step_costs(measuring, shapes, config)
    assert {(s, k) for s, row in table.items() for k in row} == cells
    assert set(measuring.runs) == cells and set(measuring.runs.values()) == {4}  # 1 + 3 timed
    loading = CountingRunner("test-runner")
    assert step_costs(loading, shapes, config) == table
    assert loading.runs == collections.Counter(dict.fromkeys(cells, 1))
