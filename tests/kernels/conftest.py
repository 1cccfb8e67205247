"""Fixtures for the tests marked `gpu`: they fail (never pass silently) where no GPU is visible.
The `nvcc` test runs last, its compiles started in the background when the session is
collected (nvcc_check.py)."""

from __future__ import annotations

import pytest

from tests.kernels import nvcc_check


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    nvcc_items = [item for item in items if item.get_closest_marker("nvcc")]
    if not nvcc_items or not nvcc_check.can_compile():
        return
    items[:] = [item for item in items if item not in nvcc_items] + nvcc_items
    config.stash[nvcc_check.COMPILES] = nvcc_check.start_compiles()


def pytest_unconfigure(config):
    nvcc_check.stop(config.stash.get(nvcc_check.COMPILES, None))


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
