"""The engine around the core: `LLMEngine` (one step: schedule, execute, update, outputs),
`AsyncLLM` and its output collector, the output processor and detokenizer, stats and stat
loggers."""

from pagedjax.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
