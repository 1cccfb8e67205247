"""The OpenAI-compatible HTTP server over AsyncLLM (`pagedjax serve`); see api_server.py."""
