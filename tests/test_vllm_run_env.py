"""The engine runner's environment: OpenMP threads stop spinning soon after a parallel region
(GOMP_SPINCOUNT), unless the caller already chose how OpenMP waits."""

from __future__ import annotations

from ucm.vllm_run import OPENMP_SPIN, engine_env


def test_engine_env_sets_a_short_openmp_spin_only_where_none_is_chosen():
    assert engine_env({"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": OPENMP_SPIN}
    assert engine_env({"GOMP_SPINCOUNT": "0"}) == {"GOMP_SPINCOUNT": "0"}
    assert engine_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    source = {"A": "1"}
    engine_env(source)
    assert source == {"A": "1"}  # a copy: the caller's mapping is left alone

