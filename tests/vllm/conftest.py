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

    spec = ModelSpec(dtype="bfloat16", max_positions=4096, seed=1)
    return str(build_model(tmp_path_factory.mktemp("tiny-bf16"), spec))


@pytest.fixture(scope="session")
def restarted(tiny_model, tmp_path_factory):
    """One cold and one warm `ucm serve` server on one store, shared by test_server.py's restart
    test and test_metrics_prometheus.py: each workload's counts are its own
    (serving_support.restarted_pair)."""
    pytest.importorskip("openai")
    from serving_support import restarted_pair

    return restarted_pair(tiny_model, tmp_path_factory.mktemp("restarted"))
