"""The one native extension (everything else is in pyproject.toml): `ucm._hostcopy`, a copy
that takes the block's xxh3 on the way (native/hostcopy*.c). Optional: without a C compiler or
xxhash.h (Debian libxxhash-dev) ucm installs and runs, verifying with xxh3 then memmove."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ucm._hostcopy", ["native/hostcopy.c", "native/hostcopy_avx2.c"],
                             depends=["native/hostcopy_impl.h"], optional=True,
                             extra_compile_args=["-O3"])])
