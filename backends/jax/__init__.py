"""JAX backend. The engine sizes its own KV pool, so JAX must not preallocate 75 % of the GPU;
the allocator reads this when the GPU client starts (first device use), after import."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
