"""Engines and devices across processes: releasing every engine (parallel_state.py, vLLM's
`vllm.distributed`) and how a model splits over tensor-parallel devices (tensor_parallel.py)."""

from pagedjax.distributed.parallel_state import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
