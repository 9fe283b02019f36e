"""Fixtures for the tests on real vLLM: tiny random models built into tmp dirs, and engines
run in fresh processes (`ucm.bench.engines.run_in_subprocess`)."""

from __future__ import annotations

import random

import pytest


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    pytest.importorskip("vllm")
    from ucm.bench.models import ModelSpec, build_model

    return str(build_model(tmp_path_factory.mktemp("tiny"), ModelSpec(max_positions=33792)))


@pytest.fixture(scope="session")
def tiny_bf16_model(tmp_path_factory):
    pytest.importorskip("vllm")
    from ucm.bench.models import ModelSpec, build_model

    # bf16 whatever the CPU (not native_dtype()): its one user tests bf16 blocks of 128 tokens
    spec = ModelSpec(dtype="bfloat16", max_positions=4096, seed=1)
    return str(build_model(tmp_path_factory.mktemp("tiny-bf16"), spec))
