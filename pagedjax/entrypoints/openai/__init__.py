"""The OpenAI-compatible HTTP server (`pagedjax serve`): vLLM's protocol, serving classes and
errors, over `AsyncLLM`."""
