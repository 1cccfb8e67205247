"""The ways in: the `LLM` class, the `pagedjax` command (generate, serve, convert, bench, doctor)
and the OpenAI-compatible server (`entrypoints/openai/`)."""
