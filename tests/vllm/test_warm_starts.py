"""Warm engine starts (ucm/bench/_warm.py): engine processes forked from one process that
imported vLLM answer as fresh ones do; an environment that differs in what is read at load
starts a fresh process; a forked engine that fails says why, and a killed one ends."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from ucm.bench import _warm, engines

PROMPT = list(range(1, 300))


def _spec(model: str, store) -> engines.EngineSpec:
    return engines.EngineSpec(model=model, max_model_len=2048, kv_cache_bytes=64 * 2**20,
                              connector="ucm",
                              ucm={"tiers": [{"driver": "posix", "path": str(store)}]})


def _engine_env() -> dict[str, str]:
    return engines.engine_env(os.environ, tcmalloc=engines.find_tcmalloc())


def _run(spec: engines.EngineSpec, log, env=None) -> tuple[dict, type]:
    with engines.EngineProcess(spec, env=env, log_path=str(log)) as engine:
        phase = engine.run(engines.Phase([PROMPT], max_tokens=4, name="p"))
        out = engine.finish()
        return {**out, "phase": phase}, type(engine._proc)


def test_forked_engines_answer_as_a_fresh_one(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("UCM_ENGINE_WARM_START", "1")
    spec = _spec(tiny_model, tmp_path / "store")
    # LD_PRELOAD is read at load: an engine with another one is a fresh process (on glibc)
    fresh, fresh_kind = _run(spec, tmp_path / "fresh.log", env={"LD_PRELOAD": ""})
    first, first_kind = _run(spec, tmp_path / "first.log")
    warm = _warm.warm_starts(_engine_env())
    second, second_kind = _run(spec, tmp_path / "second.log")
    assert fresh_kind is not _warm.WarmChild and fresh["allocator"] == "glibc"
    assert first_kind is second_kind is _warm.WarmChild and warm is not None
    assert _warm.warm_starts(_engine_env()) is warm
    # what its own imports set (OpenCV's LD_LIBRARY_PATH) is as good as what it started with
    assert warm.loaded_env is not None and warm.accepts({**_engine_env(), **warm.loaded_env})
    assert not warm.accepts({**_engine_env(), "PYTHONPATH": "/elsewhere"})
    # a library it has loaded (torch's libgomp, which vLLM's CPU platform preloads) may be
    # added to LD_PRELOAD; one it has not may not
    import torch

    gomp = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    ours = warm.load_env.get("LD_PRELOAD", "")
    assert warm.accepts({**_engine_env(), "LD_PRELOAD": f"{ours}:{gomp}".lstrip(":")})
    assert not warm.accepts({**_engine_env(), "LD_PRELOAD": f"{ours}:/lib/no-such.so".lstrip(":")})
    # the fresh engine stored the prompt's 9 full blocks; both forked ones loaded them
    assert fresh["phase"]["num_cached_tokens"] == [0]
    assert first["phase"]["num_cached_tokens"] == second["phase"]["num_cached_tokens"] == [288]
    assert first["phase"]["tokens"] == second["phase"]["tokens"] == fresh["phase"]["tokens"]
    assert first["stats"]["worker"]["loaded_blocks"] == 9
    assert "Initializing a V1 LLM engine" in (tmp_path / "first.log").read_text()


def test_a_forked_engine_that_fails_says_why_and_a_killed_one_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("UCM_ENGINE_WARM_START", "1")
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match="engine process failed") as failed:
        _run(_spec(str(missing), tmp_path / "store"), tmp_path / "bad.log")
    assert "no-such-model" in str(failed.value)  # the child's traceback, from its log
    engine = engines.EngineProcess(_spec(str(missing), tmp_path / "store"))
    with engine:
        assert isinstance(engine._proc, _warm.WarmChild)
        engine.kill()  # SIGKILL to its group; wait() returns once it has ended
        assert engine._proc._pidfd is None
