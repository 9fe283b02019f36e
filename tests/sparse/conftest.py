"""One torch thread: the sparse tests are small, and a shared CPU makes thread pools spin."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
