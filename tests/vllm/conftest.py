"""Fixtures for the tests on real vLLM: tiny random models built into tmp dirs, engines run in
fresh processes (`ucm.bench.engines.run_in_subprocess`), two of them at a time where a module
starts them ahead (`engine_pool`)."""

from __future__ import annotations

import importlib.util
import os
import random
from concurrent.futures import Future, ThreadPoolExecutor

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


@pytest.fixture(scope="session", autouse=True)
def session_ahead(request: pytest.FixtureRequest, tmp_path_factory) -> dict[str, Future]:
    """Session runs started at this directory's first test, on a lane of their own beside
    `engine_pool`: the `restarted` server pair, when a selected test reads it. Its two servers
    start one after the other, mostly one core's work each, while the first modules here leave
    a core idle (one engine at a time)."""
    uses = any("restarted" in getattr(item, "fixturenames", ())
               for item in request.session.items)
    if not uses or any(importlib.util.find_spec(m) is None for m in ("vllm", "openai")):
        yield {}
        return
    from serving_support import restarted_pair

    model = request.getfixturevalue("tiny_model")
    lane = ThreadPoolExecutor(max_workers=1)
    yield {"restarted": lane.submit(restarted_pair, model, tmp_path_factory.mktemp("restarted"))}
    lane.shutdown(cancel_futures=True)


@pytest.fixture(scope="session")
def restarted(session_ahead: dict[str, Future]):
    """One cold and one warm `ucm serve` server on one store, shared by test_server.py's restart
    test and test_metrics_prometheus.py: each workload's counts are its own
    (serving_support.restarted_pair); started ahead (`session_ahead`)."""
    pytest.importorskip("openai")
    pytest.importorskip("vllm")
    return session_ahead["restarted"].result()


@pytest.fixture(scope="session")
def tp2_served(tiny_model, tmp_path_factory, engine_pool):
    """One cold and one warm TP=2 `ucm serve` server on one store, and a TP=2 engine with no
    connector, shared by test_server.py's TP=2 test and test_tp.py: each workload's counts are
    its own (serving_support.tp2_pair)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 on CPU needs two CPUs to bind its two workers to")
    pytest.importorskip("openai")
    from serving_support import tp2_pair

    return tp2_pair(tiny_model, tmp_path_factory.mktemp("tp2"), engine_pool)


@pytest.fixture(scope="session")
def engine_pool():
    """Runs engine processes two at a time (one on a one-CPU machine). Most of an engine's
    start is Python importing vLLM and torch, one core's work: on two cores two independent
    engines take about the time of one. A module submits the runs its tests read, at its
    start; a run that needs another's store waits for that run's future."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(2, len(os.sched_getaffinity(0)))))
    yield pool
    pool.shutdown(cancel_futures=True)  # runs no test is left to read


def selected(request: pytest.FixtureRequest) -> set[str]:
    """The names of the requesting module's test functions that this session runs: a module
    starts ahead only the runs that those read."""
    return {getattr(item, "originalname", item.name) for item in request.session.items
            if getattr(item, "module", None) is request.module}
