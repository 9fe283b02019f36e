"""Fixtures for the tests on real SGLang (helpers: sglang_support.py)."""

from __future__ import annotations

import pytest
from sglang_support import sglang_missing


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random fp32 Llama, built once (ucm.bench.models)."""
    reason = sglang_missing()
    if reason:
        pytest.skip(reason)
    from ucm.bench.models import ModelSpec, build_model

    return str(build_model(tmp_path_factory.mktemp("sglang-model"), ModelSpec(dtype="float32")))
