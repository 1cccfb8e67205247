"""Tool-call parsers (vLLM's `--tool-call-parser`): each finds a model family's tool calls in its
text, whole or while it streams. Importing this package registers them all."""

from pagedjax.entrypoints.openai.tool_parsers import (  # noqa: F401  (each registers itself)
    hermes_tool_parser,
    llama_tool_parser,
    pythonic_tool_parser,
)
from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)

__all__ = ["ToolParser", "ToolParserManager"]
