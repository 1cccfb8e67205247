"""Fixtures for the tests marked `gpu`: they fail (never pass silently) where no GPU is visible."""

from __future__ import annotations

import pytest


@pytest.fixture
def jax_gpu():
    """The first GPU JAX sees."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.fail(f"needs a GPU visible to JAX, found {jax.devices()}: this test is marked "
                    f"gpu; deselect it with -m 'not gpu' on a machine without one")
    return jax.devices()[0]


@pytest.fixture
def torch_cuda():
    """The current CUDA device of torch."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("needs a GPU visible to torch (a CUDA build of torch): this test is marked "
                    "gpu; deselect it with -m 'not gpu' on a machine without one")
    return torch.device("cuda", torch.cuda.current_device())
