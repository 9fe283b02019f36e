"""The engine runner's environment: OpenMP threads stop spinning soon after a parallel region
(GOMP_SPINCOUNT), unless the caller already chose how OpenMP waits; tcmalloc is preloaded
where the system has it, unless the caller already chose an allocator. The engine's default
dtype follows the CPU's bf16 instructions."""

from __future__ import annotations

from ucm.bench.engines import OPENMP_SPIN, cpu_flags, engine_env, find_tcmalloc, native_dtype


def test_engine_env_sets_a_short_openmp_spin_only_where_none_is_chosen():
    assert engine_env({"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": OPENMP_SPIN}
    assert engine_env({"GOMP_SPINCOUNT": "0"}) == {"GOMP_SPINCOUNT": "0"}
    assert engine_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    source = {"A": "1"}
    engine_env(source)
    assert source == {"A": "1"}  # a copy: the caller's mapping is left alone


def test_engine_env_preloads_tcmalloc_unless_an_allocator_is_chosen():
    lib = "/opt/libtcmalloc_minimal.so.4"
    assert engine_env({}, tcmalloc=lib)["LD_PRELOAD"] == lib
    assert engine_env({"LD_PRELOAD": "/x/libgomp.so"}, tcmalloc=lib)["LD_PRELOAD"] == \
        f"{lib}:/x/libgomp.so"
    for chosen in ("/x/libjemalloc.so.2", "/y/libtcmalloc.so.4", "/z/libmimalloc.so"):
        assert engine_env({"LD_PRELOAD": chosen}, tcmalloc=lib)["LD_PRELOAD"] == chosen
    assert "LD_PRELOAD" not in engine_env({"UCM_ENGINE_MALLOC": "system"}, tcmalloc=lib)
    assert "LD_PRELOAD" not in engine_env({}, tcmalloc=None)  # not installed


def test_find_tcmalloc_takes_the_first_library_present(tmp_path):
    there = tmp_path / "libtcmalloc_minimal.so.4"
    there.write_bytes(b"")
    assert find_tcmalloc((str(tmp_path / "missing.so"), str(there))) == str(there)
    assert find_tcmalloc((str(tmp_path / "missing.so"),)) is None


def test_native_dtype_is_bf16_only_where_the_cpu_has_bf16_instructions():
    for flags in ({"avx2", "avx512f", "avx512_bf16"}, {"avx2", "amx_bf16", "amx_tile"}):
        dtype, why = native_dtype(flags)
        assert dtype == "bfloat16" and (flags & {"avx512_bf16", "amx_bf16"}).pop() in why
    dtype, why = native_dtype({"avx2", "avx512f", "fma"})
    assert dtype == "float32" and "no bf16" in why
    assert native_dtype(set())[0] == "float32"  # flags unknown
    assert native_dtype() == native_dtype(cpu_flags())  # this host's /proc/cpuinfo


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == set()
