"""Reasoning parsers (vLLM's `--reasoning-parser`): each splits a model family's reasoning from
its answer, whole or while it streams. Importing this package registers them all."""

from pagedjax.reasoning import (  # noqa: F401  (each registers itself)
    deepseek_r1_reasoning_parser,
    qwen3_reasoning_parser,
)
from pagedjax.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager

__all__ = ["ReasoningParser", "ReasoningParserManager"]
