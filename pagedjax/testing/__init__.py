"""Helpers for tests and benchmarks, not for serving: tiny random checkpoints of every
architecture and a tokenizer trained on this Python's standard library (checkpoints.py)."""
