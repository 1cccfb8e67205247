"""The backend-free engine core: block manager, KV-cache sizing, sequences, the scheduler and its
output, stopping, the step's packed batch, request policies (n > 1, beam search), the speculative
policy, and the `ModelRunner` protocol with the backend registry.

Nothing here imports jax, flax, torch, transformers or tokenizers (tests/core/test_purity.py).
"""
