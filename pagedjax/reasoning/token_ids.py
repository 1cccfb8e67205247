"""A reasoning parser's marker tokens, for the engine: structured outputs start after the end
marker (structured_output/manager.py)."""

from __future__ import annotations

from typing import Any


def reasoning_token_ids(name: str | None, tokenizer: Any | None
                        ) -> tuple[int | None, int] | None:
    """(start, end) token ids of reasoning parser `name`'s markers (start None where the
    tokenizer has no single token for it); None without a parser. Raises ValueError naming an
    unknown parser, or a tokenizer without a single token for the end marker."""
    if name is None:
        return None
    from pagedjax.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    if parser.end_token_id is None:
        raise ValueError(f"reasoning_parser={name!r} needs {parser.end_token!r} to be one token "
                         "of the model's tokenizer, and it is not; this model does not reason "
                         "in that format: leave reasoning_parser out.")
    return parser.start_token_id, parser.end_token_id
