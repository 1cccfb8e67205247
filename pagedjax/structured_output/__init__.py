"""Structured outputs: a JSON schema, regex, choice or grammar constrains what a completion
samples (llguidance matchers on the host, a token bitmask applied on the device)."""

from pagedjax.structured_output.grammar import GrammarCompiler, grammar_key
from pagedjax.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarCompiler", "StructuredOutputManager", "grammar_key"]
