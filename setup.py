"""The package list and the native extensions (everything else is in pyproject.toml).

Packages are found, not listed: every directory under ucm/ with an __init__.py, plus the two
that live outside it (pyproject.toml's package-dir maps them): `ucm.tools` (tools/) and
`ucm.native` (native/: C and CUDA sources only, shipped as package data). tests/test_packaging.py
checks the list against the tree.

The extensions: `ucm._hostcopy`, a copy that takes the block's xxh3 on the way
(native/hostcopy*.c), `ucm._kvcodec`, the int8/int4 KV decoding loop (native/kvcodec*.c), and
`ucm._mrcsim`, the live miss-ratio curve's miniature caches (native/mrcsim.c). Optional: without
a C compiler or xxhash.h (Debian libxxhash-dev) ucm installs and runs, verifying with xxh3 then
memmove, decoding with numpy, simulating the curve's miniatures in Python."""

from setuptools import Extension, find_packages, setup

# Packages whose directory is not ucm/<name>/ (pyproject.toml [tool.setuptools] package-dir).
# ucm.native and ucm.tools.grafana hold data only (sources, the dashboard): listed so that
# setuptools ships them as packages rather than warning about directories it would skip.
MAPPED = ["ucm.tools", "ucm.native", "ucm.tools.grafana"]

setup(packages=[*find_packages(include=["ucm", "ucm.*"]), *MAPPED],
      ext_modules=[Extension("ucm._hostcopy", ["native/hostcopy.c", "native/hostcopy_avx2.c"],
                             depends=["native/hostcopy_impl.h"], optional=True,
                             extra_compile_args=["-O3"]),
                   # the int8/int4 KV decoding loop (native/kvcodec*.c); numpy without it
                   Extension("ucm._kvcodec", ["native/kvcodec.c", "native/kvcodec_avx2.c"],
                             depends=["native/kvcodec_impl.h"], optional=True,
                             # no fused multiply-add: bit for bit the numpy reference
                             extra_compile_args=["-O3", "-ffp-contract=off"]),
                   # the live miss-ratio curve's miniature caches (native/mrcsim.c)
                   Extension("ucm._mrcsim", ["native/mrcsim.c"], optional=True,
                             extra_compile_args=["-O2"])])
