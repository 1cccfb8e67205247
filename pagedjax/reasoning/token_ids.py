"""The engine's reasoning parser: structured outputs start after its end marker
(structured_output/manager.py), which must be one token of the model's tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedjax.reasoning import ReasoningParser


def engine_reasoning_parser(name: str | None, tokenizer: Any | None
                            ) -> ReasoningParser | None:
    """Reasoning parser `name` over the tokenizer; None without one. Raises ValueError naming
    an unknown parser, or a tokenizer without a single token for the end marker."""
    if name is None:
        return None
    from pagedjax.reasoning import ReasoningParserManager  # the parsers, on first use

    parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    if parser.end_token_id is None:
        raise ValueError(f"reasoning_parser={name!r} needs {parser.end_token!r} to be one token "
                         "of the model's tokenizer, and it is not; this model does not reason "
                         "in that format: leave reasoning_parser out.")
    return parser
